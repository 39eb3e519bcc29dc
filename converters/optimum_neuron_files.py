"""What optimum-neuron 0.4.5's own readers need in a ``checkpoint-N/`` folder besides the NxD tag ``shards/``.

Every fact here is read from optimum-neuron v0.4.5 (``optimum/neuron/models/training/...``, cited ``file:line``) and
checked against that code itself in ``tests_trainium/`` (its ``create_parameter_metadata`` on its own model classes,
its consolidation on our folders):

* the layout its model classes build (:func:`fit_flags`): ``LlamaAttention`` uses NxD's
  ``GQAQKVColumnParallelLinear`` exactly when the KV heads are fewer than the TP degree or not divisible by it
  (``llama/modeling_llama.py:316``), with ``trn_config.kv_size_multiplier`` or else ``max(1, tp // kv_heads)``
  (``:318-323``, ``config.py:62-69``); a fused ``qkv_proj`` (stride 3) only for MHA without it (``:355-375``);
  ``gate_up_proj`` always fused (``:196-215``); no attention or MLP bias (``bias=False`` throughout).  KV copies
  are tiled (``W.repeat(m)``) whatever the chip: its loading (``transformations_utils.py:862``) and its
  consolidation (``:1265``, copy 0 of ``torch.chunk``) both assume it, so a ``--hw trn2`` (interleaved) layout is
  refused rather than written for a reader that would take the wrong heads;
* ``shards/mp_metadata_pp_rank_P.json`` (:func:`mp_metadata`), what ``save_pretrained`` writes
  (``modeling_utils.py:1490-1497``) from ``create_parameter_metadata`` (``transformations_utils.py:1659-1686``) and
  what ``consolidate_model_parallel_checkpoints`` reads (``checkpointing.py:138-142``);
* ``trn_config.json`` (:func:`trn_config`): ``asdict(TrainingNeuronConfig)`` (``modeling_utils.py:1518-1522``,
  fields ``config.py:14-28``);
* ``training_args.bin`` and the tokenizer files (:func:`side_files`): ``NeuronTrainer.save_model`` writes
  ``torch.save(self.args)`` and ``processing_class.save_pretrained`` (``trainers/transformers.py:1280``, ``:1313``);
  copied byte for byte from a source folder that has them, never unpickled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpt.errors import LayoutError
from ckpt.layouts.spec import NxdFlags

#: the model types optimum-neuron 0.4.5 has training classes for that ckpt's layout rules know
#: (``models/training/auto_models.py:31-37`` registers llama, granite and qwen3; ckpt has no granite family)
TRAINING_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

#: ``TrainingNeuronConfig``'s fields and defaults, in declaration order (``models/training/config.py:14-28``)
TRN_CONFIG_DEFAULTS: dict[str, Any] = {
    "tensor_parallel_size": 1, "sequence_parallel_enabled": False, "kv_size_multiplier": None,
    "pipeline_parallel_size": 1, "virtual_pipeline_parallel_size": 1, "pipeline_parallel_num_microbatches": 1,
    "pipeline_parallel_use_zero1_optimizer": False, "gradient_checkpointing": False, "checkpoint_dir": None,
    "num_local_ranks_per_step": 8, "use_xser": True, "async_save": False, "fuse_qkv": False,
    "recompute_causal_mask": True, "transpose_nki_inputs": True,
}  # fmt: skip

#: ``transformers.trainer.TRAINING_ARGS_NAME`` (transformers 4.57 ``trainer.py:296``)
TRAINING_ARGS = "training_args.bin"
#: what ``PreTrainedTokenizerBase.save_pretrained`` writes (transformers 4.57 ``tokenization_utils_base.py:153-158``,
#: ``utils/hub.py:75``) and the vocabulary files of the tokenizers of these families (``tokenizer.model``: Llama's
#: ``VOCAB_FILES_NAMES``, ``models/llama/tokenization_llama_fast.py:31``; ``vocab.json`` / ``merges.txt``: Qwen's,
#: ``models/qwen2/tokenization_qwen2.py:31``)
TOKENIZER_FILES = (
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json", "chat_template.jinja",
    "tokenizer.model", "vocab.json", "merges.txt",
)  # fmt: skip


def _dims(config: Mapping[str, Any]) -> tuple[int, int, int]:
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return heads, kv, hd


def check_model(config: Mapping[str, Any] | None, where: str) -> None:
    """Refuse a model optimum-neuron 0.4.5 cannot train (no training class, or a bias its layers do not have)."""
    if config is None:
        raise LayoutError(f"{where}: --format optimum-neuron needs the model's config.json (pass --config)")
    mt = config.get("model_type")
    if mt not in TRAINING_CLASSES:
        raise LayoutError(
            f"{where}: optimum-neuron 0.4.5 has no training model for model_type {mt!r} "
            f"(it trains {', '.join(sorted(TRAINING_CLASSES))} and granite: models/training/auto_models.py); "
            "use --format nxd"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise LayoutError(
                f"{where}: config.json {flag}=true, but optimum-neuron 0.4.5's {TRAINING_CLASSES[mt]} has no "
                "bias in its projections (bias=False, llama/modeling_llama.py:205-417); use --format nxd"
            )


def fit_flags(flags: NxdFlags, given: Mapping[str, Any], config: Mapping[str, Any] | None) -> NxdFlags:
    """The layout optimum-neuron's model classes build at ``flags.tp`` (see the module docstring): the flags the
    caller did not give are set to it, a given one that contradicts it is refused in one line."""
    check_model(config, "--format optimum-neuron")
    assert config is not None
    heads, kv, _ = _dims(config)
    qkv_linear = kv < flags.tp or kv % flags.tp != 0  # llama/modeling_llama.py:316
    why = f"num_key_value_heads={kv} at --tp {flags.tp} (llama/modeling_llama.py:316)"
    if "qkv_linear" in given and bool(given["qkv_linear"]) != qkv_linear:
        raise LayoutError(
            f"--{'no-' if qkv_linear else ''}qkv-linear: optimum-neuron 0.4.5's model "
            f"{'uses' if qkv_linear else 'does not use'} GQAQKVColumnParallelLinear with {why}; drop the flag"
        )
    if given.get("hw", "trn1") != "trn1":
        raise LayoutError(
            f"--hw {given['hw']}: optimum-neuron 0.4.5 tiles KV copies (W.repeat) on every chip when it loads "
            "(transformations_utils.py:862) and consolidates (:1265); the trn1 order is the one it reads, drop --hw"
        )
    if qkv_linear:
        mult = int(given.get("kv_size_multiplier") or max(1, flags.tp // kv))  # config.py:62-69
    else:
        if int(given.get("kv_size_multiplier") or 1) != 1:
            raise LayoutError(
                f"--kv-size-multiplier {given['kv_size_multiplier']}: optimum-neuron 0.4.5 replicates no KV head "
                f"with {why}; drop the flag"
            )
        mult = 1
    # a fused QKV exists for GQAQKVColumnParallelLinear, or for MHA without it (:355); else q/k/v stay apart
    fuse = bool(flags.fuse_qkv) and (qkv_linear or heads == kv)
    return dataclasses.replace(
        flags, qkv_linear=qkv_linear, kv_size_multiplier=mult, hw="trn1", fuse_qkv=fuse
    )


#: NxD's partition attributes of the parameters of optimum-neuron's model classes, by name suffix:
#: (partition_dim, partition_stride); None: NxD sets none (a replicated parameter)
_PARTITION = (
    ("embed_tokens.weight", (0, 1)),  # ParallelEmbedding (vocab-parallel), llama/modeling_llama.py:604
    ("lm_head.weight", (0, 1)),  # ColumnParallelLinear, :711
    ("self_attn.q_proj.weight", (0, 1)), ("self_attn.k_proj.weight", (0, 1)),
    ("self_attn.v_proj.weight", (0, 1)),  # ColumnParallelLinear, :378-407
    ("self_attn.qkv_proj.weight", (0, 3)),  # ColumnParallelLinear stride 3 (MHA), :356
    ("self_attn.qkv_proj.weight_q", (0, 1)), ("self_attn.qkv_proj.weight_k", (0, 1)),
    ("self_attn.qkv_proj.weight_v", (0, 1)),  # GQAQKVColumnParallelLinear, :328
    # fused: NxD re-creates weight_qkv by torch.cat without TP attributes (NxD qkv_linear.py:541), as
    # optimum-neuron notes (transformations_utils.py:1215-1219)
    ("self_attn.qkv_proj.weight_qkv", None),
    ("self_attn.o_proj.weight", (1, 1)), ("mlp.down_proj.weight", (1, 1)),  # RowParallelLinear, :408, :216
    ("mlp.gate_up_proj.weight", (0, 2)),  # ColumnParallelLinear stride 2, :205
    ("layernorm.weight", None), ("norm.weight", None),  # RMSNorms (and Qwen3's q_norm / k_norm)
)  # fmt: skip


def parameter_entry(name: str, tp: int) -> dict[str, Any]:
    """``create_parameter_metadata``'s entry for parameter ``name`` (``transformations_utils.py:1665-1674``)."""
    for suffix, part in _PARTITION:
        if name.endswith(suffix):
            if part is None:
                return {"tensor_model_parallel": False}
            return {
                "tensor_model_parallel": True, "partition_dim": part[0], "partition_stride": part[1],
                "num_partitions": tp,
            }  # fmt: skip
    raise LayoutError(f"{name}: not a parameter of optimum-neuron 0.4.5's training model classes")


def _attention_specs(layer: str, flags: NxdFlags, config: Mapping[str, Any]) -> list[Any]:
    heads, kv, hd = _dims(config)
    if flags.qkv_linear:  # GQAQKVColumnParallelLinearSpec, llama/modeling_llama.py:340-354
        return [["GQAQKVColumnParallelLinearSpec", {
            "gqa_qkv_projection_name": "qkv_proj", "query_projection_name": "q_proj", "key_projection_name": "k_proj",
            "value_projection_name": "v_proj", "output_projection_name": "o_proj", "num_attention_heads": heads,
            "num_key_value_heads": kv, "kv_size_multiplier": flags.kv_size_multiplier,
            "q_output_size_per_partition": heads * hd // flags.tp,
            "kv_output_size_per_partition": kv * flags.kv_size_multiplier * hd // flags.tp,
            "fuse_qkv": flags.fuse_qkv, "bias": False, "tp_size": flags.tp, "peft_type": None,
        }]]  # fmt: skip
    if flags.fuse_qkv:  # FusedLinearsSpec of the MHA qkv_proj, :367-375
        return [["FusedLinearsSpec", {
            "fused_linear_name": "qkv_proj", "linear_names": ["q_proj", "k_proj", "v_proj"], "bias": False,
            "fuse_axis": 0, "original_dims": [heads * hd] * 3, "tp_size": flags.tp, "peft_type": None,
        }]]  # fmt: skip
    return []


def _mlp_specs(config: Mapping[str, Any], tp: int) -> list[Any]:
    """``LlamaMLP``'s ``FusedLinearsSpec`` (llama/modeling_llama.py:196-204; ``fuse_axis="column"`` is 0)."""
    return [["FusedLinearsSpec", {
        "fused_linear_name": "gate_up_proj", "linear_names": ["gate_proj", "up_proj"], "bias": False,
        "fuse_axis": 0, "original_dims": [int(config["intermediate_size"])] * 2, "tp_size": tp, "peft_type": None,
    }]]  # fmt: skip


def mp_metadata(names: list[str], flags: NxdFlags, config: Mapping[str, Any]) -> dict[str, Any]:
    """``mp_metadata_pp_rank_P.json`` of the PP stage holding parameters ``names`` (in the model's order).

    ``create_parameter_metadata`` (``transformations_utils.py:1659-1686``) lists this stage's parameters, then every
    ``CustomModule`` of the whole model (each layer's ``self_attn``, then ``mlp``, in ``named_modules`` order) with
    the specs that touch a parameter of this stage (``to_metadata``, ``:247-262``): a module of another stage is
    listed with no specs."""
    on_stage = set(names)
    specs = []
    for i in range(int(config["num_hidden_layers"])):
        for module, made in (
            (f"model.layers.{i}.self_attn", _attention_specs(f"model.layers.{i}", flags, config)),
            (f"model.layers.{i}.mlp", _mlp_specs(config, flags.tp)),
        ):
            relevant = any(n.startswith(module + ".") for n in on_stage)
            specs.append({"module_fully_qualified_name": module, "specs": made if relevant else []})
    return {
        "parameters": {n: parameter_entry(n, flags.tp) for n in names},
        "model_weight_transformation_specs": specs,
    }


def trn_config(base: Mapping[str, Any], flags: NxdFlags, xser: bool) -> dict[str, Any]:
    """``trn_config.json``: every ``TrainingNeuronConfig`` field (its defaults, then the source's own
    ``trn_config.json``), with the sizes and flags of the layout written."""
    out = {**TRN_CONFIG_DEFAULTS, **{k: v for k, v in base.items() if k in TRN_CONFIG_DEFAULTS}}
    out.update(
        tensor_parallel_size=flags.tp, pipeline_parallel_size=flags.pp,
        virtual_pipeline_parallel_size=flags.virtual_pp,
        kv_size_multiplier=flags.kv_size_multiplier if flags.qkv_linear else out["kv_size_multiplier"],
        fuse_qkv=flags.fuse_qkv, use_xser=xser,
    )  # fmt: skip
    return out


def side_files(source_path: str | None) -> dict[str, Path]:
    """``{name: path}``: ``training_args.bin`` and the tokenizer files of the source folder, to copy byte for byte."""
    if not source_path or "://" in source_path:
        return {}
    root = Path(source_path)
    if not root.is_dir():
        return {}
    return {n: root / n for n in (TRAINING_ARGS, *TOKENIZER_FILES) if (root / n).is_file()}


__all__ = [
    "TOKENIZER_FILES",
    "TRAINING_ARGS",
    "TRAINING_CLASSES",
    "TRN_CONFIG_DEFAULTS",
    "check_model",
    "fit_flags",
    "mp_metadata",
    "parameter_entry",
    "side_files",
    "trn_config",
]
