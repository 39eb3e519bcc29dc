"""A LoRA adapter written as optimum-neuron's ``NeuronPeftModel.save_pretrained`` writes it (optimum-neuron 0.4.5).

What its save writes (``optimum/neuron/peft/peft_model.py`` ``NeuronPeftModel.save_pretrained``), and so what this
module writes, for adapter ``NAME`` (``default`` for a PEFT folder) in ``DST``:

* ``adapter_NAME/adapter_shards/``: an NxD tag, ``neuronx_distributed.trainer.save_checkpoint(tag="adapter_shards",
  model=get_peft_model_state_dict(...), use_xser=trn_config.use_xser)``: one ``model/dp_rank_00_tp_rank_TT_pp_rank_PP``
  file per (tp, pp) rank holding that rank's LoRA shards under PEFT's names without the adapter name
  (``base_model.model.`` + the NxD module: ``...q_proj.lora_B.weight``, ``...qkv_proj.lora_B.weight_q``,
  ``...gate_up_proj.lora_B.weight``).  The shards are NxD's LoRA layout (:mod:`ckpt.layouts.lora`), which is
  optimum-neuron's: its LoRA layers (``peft/tuners/lora/layer.py``) wrap NxD's parallel layers the same way;
* ``adapter_shards/mp_metadata_pp_rank_P.json``: ``create_parameter_metadata`` (``models/training/
  transformations_utils.py``): ``parameters`` (each adapter parameter's name *with* the adapter name, and NxD's
  ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` / ``num_partitions``) and
  ``model_weight_transformation_specs`` (``FusedLinearsSpec`` for ``gate_up_proj``, ``GQAQKVColumnParallelLinearSpec``
  for ``qkv_proj``), which its consolidation (``consolidate_model_parallel_checkpoints_to_unified_checkpoint``, what
  ``optimum-cli neuron consolidate`` runs) reads.  Its save lists every parameter of the model and a spec for every
  fused module; this one lists the adapter's parameters and the specs of the fused modules the adapter adapts, which
  is what consolidation uses (it drops base parameters from an adapter's metadata, and a spec of an unadapted
  module would look for base weights that an adapter tag never holds);
* ``adapter_NAME/adapter_config.json``: the PEFT config in the original model's module names
  (``to_original_peft_config_for_model``), i.e. the adapter's own PEFT config;
* at ``DST``: ``trn_config.json`` (so the folder is a NeuronTrainer checkpoint, :func:`.optimum_neuron.detect`),
  ``config.json`` when given, and from a Trainer folder ``trainer_state.json`` and ``scheduler.pt``.

Refused, never approximated: optimum-neuron's fused LoRA layers (``gate_up_proj``, and ``qkv_proj`` when
``GQAQKVColumnParallelLinear`` is used) hold ONE ``lora_A`` for their parts; its own loading
(``NeuronPeftModel.load_adapter`` -> ``FusedLinearsSpec._lora_adapt_state_dict``) replaces differing parts'
``lora_A`` by their mean, which changes the adapter.  So an adapter whose fused parts have different ``lora_A``
(every adapter PEFT trains on them) is refused, as is one adapting only some parts of a fused module
(optimum-neuron's ``adapt_peft_config`` refuses those too).  optimum-neuron chooses the attention layer itself
(``models/training/llama/modeling_llama.py``: ``GQAQKVColumnParallelLinear`` iff ``kv_heads < tp`` or
``kv_heads % tp``, ``kv_size_multiplier`` ``max(1, tp // kv_heads)`` unless set) and lays KV copies out tiled
(``create_kv_proj_local_weight_from_regular_weight``: ``repeat``), whatever the chip: ckpt's ``trn1`` order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpt.errors import LayoutError
from ckpt.layouts.lora import NXD_LORA, adapter_to_nxd, lora_rule
from ckpt.layouts.spec import LayoutSpec, ModelDims, NxdFlags

from .nxd.naming import rank_file_name
from .nxd.xser import save_nxd_file
from .peft import Adapter, Training

ADAPTER_SHARDS = "adapter_shards"
CONFIG_NAME = "adapter_config.json"
#: what ``get_peft_model_state_dict`` puts before a module's name
PREFIX = "base_model.model."


def optimum_layout(config: Mapping[str, Any], layout: Mapping[str, Any]) -> LayoutSpec:
    """The layout optimum-neuron's Llama gives ``config`` at the requested sizes (``layout``: NxdFlags fields);
    a flag that contradicts its choice is refused, naming it."""
    dims = ModelDims.from_hf_config(config)
    tp = int(layout.get("tp", 1))
    kv = dims.kv_heads
    qkv_linear = kv < tp or kv % tp != 0
    auto = max(1, tp // kv) if qkv_linear else 1
    mult = int(layout.get("kv_size_multiplier") or auto) if qkv_linear else 1
    want = {"qkv_linear": qkv_linear, "kv_size_multiplier": mult}
    for name, value in want.items():
        if name in layout and layout[name] is not None and layout[name] != value:
            raise LayoutError(
                f"--{name.replace('_', '-')} {layout[name]}: optimum-neuron's Llama uses {name}={value} for "
                f"{kv} KV heads at tp {tp} (GQAQKVColumnParallelLinear iff kv_heads < tp or kv_heads % tp)"
            )
    if layout.get("fuse_qkv") and not qkv_linear and dims.heads != kv:
        raise LayoutError(
            f"--fuse-qkv: optimum-neuron's Llama fuses q/k/v without GQAQKVColumnParallelLinear only when every head "
            f"has its own KV head ({dims.heads} heads, {kv} KV heads at tp {tp} keep q_proj/k_proj/v_proj apart)"
        )
    if layout.get("hw", "trn1") == "trn2" and qkv_linear and kv > 1 and mult > 1:
        raise LayoutError(
            "--hw trn2: optimum-neuron lays KV copies out tiled (repeat) on every chip, which is ckpt's trn1 "
            "order; its consolidation would misread trn2's interleaved order (use --hw trn1)"
        )
    if layout.get("ep", 1) != 1 or layout.get("virtual_pp", 1) != 1:
        raise LayoutError(
            "--format optimum-neuron adapters: expert or virtual pipeline parallelism is not supported"
        )
    flags = {n: layout[n] for n in NxdFlags.names() if n in layout and n not in ("dp", "hw")}
    return LayoutSpec.of(dims, NxdFlags(**{**flags, **want, "hw": "trn1"}))


def _tp_attributes(leaf_ab: str, module: str, spec: LayoutSpec) -> dict[str, Any]:
    """NxD's tensor-parallel attributes of one LoRA parameter (``get_tensor_model_parallel_attributes``):
    ``lora_B`` of a column-parallel base and ``lora_A`` of a row-parallel base are split; the other is whole."""
    parallel = "column" if module.endswith("qkv_proj") or module.endswith("gate_up_proj") else None
    parallel = parallel or lora_rule(module).parallel
    split = (leaf_ab == "B") == (parallel == "column")
    if not split:
        return {"tensor_model_parallel": False}
    return {
        "tensor_model_parallel": True, "partition_dim": 0 if parallel == "column" else 1,
        "partition_stride": 1, "num_partitions": spec.tp,
    }  # fmt: skip


def _spec_of(module: str, spec: LayoutSpec) -> tuple[str, str, dict[str, Any]] | None:
    """``(owner module, class name, fields)`` of the transformation spec of a fused NxD module, None for others."""
    m = spec.model
    owner, _, leaf = module.rpartition(".")
    if leaf == "gate_up_proj":
        fields = {"fused_linear_name": "gate_up_proj", "linear_names": ["gate_proj", "up_proj"], "bias": False,
                  "fuse_axis": 0, "original_dims": [m.intermediate, m.intermediate], "tp_size": spec.tp}  # fmt: skip
        return owner, "FusedLinearsSpec", fields
    if leaf == "qkv_proj" and spec.qkv_linear:
        slots = m.kv_heads * spec.kv_size_multiplier
        fields = {
            "gqa_qkv_projection_name": "qkv_proj", "query_projection_name": "q_proj", "key_projection_name": "k_proj",
            "value_projection_name": "v_proj", "output_projection_name": "o_proj", "num_attention_heads": m.heads,
            "num_key_value_heads": m.kv_heads, "kv_size_multiplier": spec.kv_size_multiplier,
            "q_output_size_per_partition": m.heads * m.head_dim // spec.tp,
            "kv_output_size_per_partition": slots * m.head_dim // spec.tp, "fuse_qkv": spec.fuse_qkv,
            "bias": False, "tp_size": spec.tp,
        }  # fmt: skip
        return owner, "GQAQKVColumnParallelLinearSpec", fields
    if leaf == "qkv_proj":
        fields = {"fused_linear_name": "qkv_proj", "linear_names": ["q_proj", "k_proj", "v_proj"], "bias": False,
                  "fuse_axis": 0, "original_dims": [m.heads * m.head_dim] * 3, "tp_size": spec.tp}  # fmt: skip
        return owner, "FusedLinearsSpec", fields
    return None


def metadata(names: list[str], spec: LayoutSpec, adapter_name: str) -> dict[str, Any]:
    """``mp_metadata_pp_rank_P.json`` for one PP stage's adapter tensors ``names`` (NxD names, no prefix)."""
    params: dict[str, Any] = {}
    owners: dict[str, list[Any]] = {}
    for name in sorted(names):
        m = NXD_LORA.match(name)
        assert m is not None, name
        mod = m["mod"]
        full = f"{PREFIX}{mod}.lora_{m['ab']}.{adapter_name}.{m['leaf']}"
        params[full] = _tp_attributes(m["ab"], mod, spec)
        found = _spec_of(mod, spec)
        if found is not None:
            owner, cls, fields = found
            specs = owners.setdefault(PREFIX + owner, [])
            if all(s[0] != cls for s in specs):
                specs.append((cls, {**fields, "peft_type": "lora"}))
    return {
        "parameters": params,
        "model_weight_transformation_specs": [
            {"module_fully_qualified_name": owner, "specs": specs} for owner, specs in owners.items()
        ],
    }


def check_whole_fused(adapter: Adapter, spec: LayoutSpec) -> None:
    """optimum-neuron adapts a fused module only when every part is a target (its ``adapt_peft_config``)."""
    parts = {"gate_proj": ("gate_proj", "up_proj"), "up_proj": ("gate_proj", "up_proj")}
    if spec.qkv_linear or spec.fuse_qkv:
        parts.update({p: ("q_proj", "k_proj", "v_proj") for p in ("q_proj", "k_proj", "v_proj")})
    for mod in adapter.modules:
        owner, _, leaf = mod.rpartition(".")
        for other in parts.get(leaf, ()):
            if f"{owner}.{other}" not in adapter.modules:
                raise LayoutError(
                    f"{mod}: adapted without {owner}.{other}; optimum-neuron fuses {'/'.join(parts[leaf])} into one "
                    "layer and adapts all of its parts or none"
                )


def write_adapter_folder(
    adapter: Adapter, spec: LayoutSpec, dst: str, *, adapter_name: str = "default", xser: bool = True,
    config: Mapping[str, Any] | None = None, step: int | None = None,
) -> int:  # fmt: skip
    """Write ``adapter`` at ``dst`` as a NeuronTrainer LoRA checkpoint folder (module docstring), checked and laid
    out whole before any byte is written, published at once.  Returns the bytes of tensor data written."""
    from ckpt.storage.folder import begin_folder

    from .hf_trainer import SCHEDULER_NAME, STATE_NAME
    from .optimum_neuron import TRN_CONFIG, _bytes_of

    check_whole_fused(adapter, spec)
    shards = adapter_to_nxd(adapter.tensors, spec)  # refuses fused parts with different lora_A
    base = f"adapter_{adapter_name}"
    nbytes = 0
    trn = {"tensor_parallel_size": spec.tp, "pipeline_parallel_size": spec.pp, "virtual_pipeline_parallel_size": 1,
           "kv_size_multiplier": spec.kv_size_multiplier if spec.qkv_linear else None, "fuse_qkv": spec.fuse_qkv,
           "use_xser": xser}  # fmt: skip
    with begin_folder(dst) as txn:
        st = txn.storage
        tag = f"{base}/{ADAPTER_SHARDS}"
        for tp, pp in spec.ranks:
            sd = {PREFIX + n: t.contiguous() for n, t in shards.get((tp, pp), {}).items()}
            nbytes += sum(t.numel() * t.element_size() for t in sd.values())
            save_nxd_file(sd, st, f"{tag}/model/{rank_file_name(0, tp, pp)}", xser)
        for pp in range(spec.pp):
            names = list(shards.get((0, pp), {}))
            st.put_bytes(f"{tag}/mp_metadata_pp_rank_{pp}.json", json.dumps(metadata(names, spec, adapter_name),
                                                                            indent=4).encode())  # fmt: skip
        st.put_bytes(f"{tag}/checkpoint", b"1")  # NxD's save_checkpoint marks the tag a checkpoint first...
        peft_cfg = adapter.to_peft_config()
        st.put_bytes(
            f"{base}/{CONFIG_NAME}", (json.dumps(peft_cfg, indent=2, sort_keys=True) + "\n").encode()
        )
        if config is not None:
            st.put_bytes("config.json", (json.dumps(dict(config), indent=2) + "\n").encode())
        st.put_bytes(TRN_CONFIG, (json.dumps(trn, indent=4) + "\n").encode())
        t = adapter.training
        if t is not None and t.scheduler is not None:
            st.put_bytes(SCHEDULER_NAME, _bytes_of(t.scheduler))
        if t is not None or step is not None:
            state = dict(t.trainer_state if t is not None else {})
            state.setdefault("log_history", [])
            state["global_step"] = step if step is not None else t.step  # type: ignore[union-attr]
            st.put_bytes(STATE_NAME, (json.dumps(state, indent=2, sort_keys=True) + "\n").encode())
        txn.commit({f"{tag}/done": b"1"})  # ...and done last
    return nbytes


def read_training(path: str) -> Training | None:
    """The Trainer state at the root of a NeuronTrainer LoRA folder (``trainer_state.json``, ``scheduler.pt``,
    ``rng_state_*.pth``), so that it converts on to a Trainer folder with its step; None when it records no step."""
    from ckpt.safe_unpickle import load_torch_file

    from .hf_trainer import SCHEDULER_NAME, STATE_NAME, read_rng_files
    from .optimum_neuron import _json, read_step

    root = Path(path)
    sched = load_torch_file(root / SCHEDULER_NAME) if (root / SCHEDULER_NAME).is_file() else None
    step = read_step(root, sched)
    if step is None:
        return None
    state = _json(root / STATE_NAME, "the Trainer state") if (root / STATE_NAME).is_file() else {}
    return Training(step, sched, read_rng_files(root), dict(state))


__all__ = ["ADAPTER_SHARDS", "metadata", "optimum_layout", "read_training", "write_adapter_folder"]
