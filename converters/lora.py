"""``ckpt convert`` for LoRA adapters: PEFT folder <-> NxD LoRA tag, and ``--merge-lora`` into a full HF model.

Adapters are small (rank x (in + out) per target), so they are converted whole in memory; the layout is
:mod:`ckpt.layouts.lora`.  Everything is read and checked before the destination is begun; the destination is
published whole (a temp folder and a rename) or not at all.

Merging (``--merge-lora ADAPTER``, SRC = the base HF folder): each adapted weight becomes ``W + scaling * (B @ A)``
computed exactly as PEFT's ``LoraLayer.get_delta_weight`` + ``merge(safe_merge=False)`` do (``B @ A`` in float32
when B is half precision on the CPU, cast to B's dtype, then ``W += delta`` in place), so the result is bit-identical
to ``PeftModel.merge_and_unload()`` on the CPU.  On a GPU PEFT multiplies half-precision B @ A in that precision
(cuBLAS) and fp32 with another summation order, so its merge can differ by one unit in the last place of W's dtype
(reasoned from PEFT's code, not measured: no GPU was available when this was written).  The base is streamed one safetensors shard at a time.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CkptError, LayoutError
from ckpt.layouts.lora import parse_hf
from ckpt.layouts.spec import LayoutSpec, ModelDims, NxdFlags

from . import peft
from .formats import Detected, detect_adapter
from .nxd import lora as nxd_lora
from .options import ConvertOptions, RunOptions


@dataclass(frozen=True)
class LoraResult:
    dst: str
    tensors: int
    bytes: int
    format: str
    #: summary lines (a widening for NxD's fused layers, or how a widened adapter came back)
    notes: tuple[str, ...] = ()


def detect(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """The format table's verb for the ``peft`` entry: a PEFT adapter folder."""
    return peft.detect(path, storage_options)


def is_adapter(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """The format table's adapter probe: every PEFT folder is an adapter."""
    return peft.detect(path, storage_options)


def open_source(path: str, **_: Any) -> Any:
    """The engine's verb: a PEFT folder is an adapter, converted whole by :func:`convert`, not a model source."""
    raise LayoutError(
        f"{path}: a PEFT LoRA adapter is not a model; convert it with --format peft|nxd or merge it into its base "
        "with --merge-lora"
    )


def export(conv: Any, **_: Any) -> Any:
    """The engine's verb: only adapters are written as PEFT folders."""
    raise LayoutError("--format peft holds a LoRA adapter; SRC must be a PEFT folder or an NxD LoRA tag")


def _found(src: str | Detected, run: RunOptions) -> Detected:
    return src if isinstance(src, Detected) else detect_adapter(src, run.storage_options)


_PEFT_NAME = re.compile(r"^(?P<mod>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")


def read_ckpt_adapter(src: str, run: RunOptions, manifest: Any = None) -> peft.Adapter:
    """The LoRA adapter of an adapter-only checkpoint saved from a PEFT model (``save(adapter_only=True)``): its
    trainable tensors (PEFT's ``...lora_A.<adapter>.weight`` names, one adapter) and the recorded PEFT config.
    ``manifest``: its top manifest, when detection read it."""
    from ckpt.format.reader import CheckpointReader

    reader = CheckpointReader(src, run.storage_options, run.verify, manifest=manifest)
    m = reader.manifest
    if m.layout.kind == "nxd":
        raise LayoutError(
            f"{src}: a Neuron-layout adapter checkpoint; convert adapters saved by NxD training from NxD's own "
            "LoRA tag (nxd.save_checkpoint with merge_sharded_lora=False)"
        )
    lora = (m.adapter or {}).get("lora") or {}
    cfg = lora.get("peft")
    if not isinstance(cfg, dict):
        raise LayoutError(
            f"{src}: the checkpoint does not record a PEFT LoRA config (adapter.lora.peft), so its scaling is "
            "unknown; it was not saved from a PeftModel"
        )
    peft.check_config(cfg, f"{src} adapter.lora.peft")
    names: set[str] = set()
    tensors: dict[str, torch.Tensor] = {}
    hf_of: dict[str, str] = {}
    for name, t in m.tensors.items():
        if t.role != "parameter":
            continue
        hf = name.removeprefix(peft.PREFIX)
        match = _PEFT_NAME.match(hf)
        if match is None:
            raise LayoutError(
                f"{src}: trainable tensor {name} is not a PEFT LoRA matrix (<module>.lora_A.<adapter>.weight)"
            )
        names.add(match["adapter"])
        hf_of[name] = f"{match['mod']}.lora_{match['ab']}.weight"
        tensors[hf_of[name]] = reader.read(name)
    if len(names) != 1:
        raise LayoutError(
            f"{src}: holds LoRA matrices of {len(names)} adapters {sorted(names)}; expected one"
        )
    for n in tensors:
        parse_hf(n)
    adapter = peft.Adapter.of_config(tensors, cfg, optimizer=_ckpt_optimizer(reader, hf_of, src))
    from .lora_ckpt import read_training

    adapter.training = read_training(reader)
    return adapter


def _need_config(opts: ConvertOptions, why: str) -> dict[str, Any]:
    if opts.config is None:
        raise CkptError(f"--config: {why} needs the base model's HF config.json")
    return opts.config


def read_any(src: str | Detected, opts: ConvertOptions, run: RunOptions) -> tuple[peft.Adapter, NxdFlags | None]:
    """The adapter at ``src`` (PEFT folder, NxD LoRA tag, optimum-neuron LoRA checkpoint or adapter checkpoint of
    ours; a path or what the format table detected) and, for a tag, the NxD layout it was stored in."""
    found = _found(src, run)
    path = found.path
    kind = found.format.name if found.adapter else None
    if kind == "peft":
        if opts.source_flags:
            raise LayoutError(f"--source-*: {path} is a PEFT folder; source flags are for NxD tags only")
        from .lora_trainer import is_trainer_folder, read_trainer_adapter

        if is_trainer_folder(path):
            return read_trainer_adapter(path, opts.config), None
        return peft.read_adapter(path), None
    if kind == "ckpt":
        if opts.source_flags:
            raise LayoutError(f"--source-*: {path} is a ckpt checkpoint, which records its own layout")
        return read_ckpt_adapter(path, run, found.manifest), None
    if kind == "optimum-neuron":
        from . import optimum_neuron

        cfg = _need_config(opts, f"reading optimum-neuron LoRA checkpoint {path}")
        if opts.source_flags:
            raise LayoutError(f"--source-*: {path}'s adapter shards record their own layout")
        from .optimum_neuron_lora import read_training

        adapter = optimum_neuron.read_lora_checkpoint(
            path, config=cfg, verify=run.verify, allow_unmarked=run.allow_unmarked
        )
        adapter.training = read_training(path)
        return adapter, None
    if kind == "nxd":
        cfg = _need_config(opts, f"reading NxD LoRA tag {path}")
        adapter, spec = nxd_lora.read_lora_tag(
            path,
            config=cfg,
            source_flags=opts.source_flags,
            allow_unmarked=run.allow_unmarked,
            verify=run.verify,
        )
        return adapter, spec.flags()
    raise LayoutError(f"{path}: not a LoRA adapter (expected a PEFT folder with {peft.CONFIG_NAME} + "
                      f"{peft.WEIGHTS_NAME}, an NxD tag of LoRA tensors or an adapter-only ckpt checkpoint)")  # fmt: skip


def _ckpt_optimizer(reader: Any, hf_of: dict[str, str], src: str) -> dict[str, Any] | None:
    """The optimizer state of an adapter checkpoint in :attr:`peft.Adapter.optimizer`'s form (HF adapter names)."""
    from ckpt.format import treecodec

    meta = reader.manifest.optimizer
    if meta is None:
        return None
    state: dict[str, dict[str, Any]] = {}
    for pname, scalars in (meta.get("state") or {}).items():
        if pname not in hf_of:
            raise LayoutError(f"{src}: optimizer state of {pname}, which is not an adapter tensor")
        state.setdefault(hf_of[pname], {}).update({k: treecodec.decode(v) for k, v in scalars.items()})
    for name, t in reader.manifest.tensors.items():
        if t.role == "optimizer_state" and t.param is not None and t.key is not None:
            if t.param not in hf_of:
                raise LayoutError(
                    f"{src}: optimizer state {name} of {t.param}, which is not an adapter tensor"
                )
            state.setdefault(hf_of[t.param], {})[t.key] = reader.read(name)
    groups = []
    for g in meta["param_groups"]:
        groups.append({**{k: treecodec.decode(v) for k, v in g.items() if k != "params"},
                       "params": [hf_of[p] for p in g["params"]]})  # fmt: skip
    return {"state": state, "param_groups": groups}


def source_step(src: str | Detected, run: RunOptions) -> int | None:
    """The step the adapter source records: an NxD tag's (``tag_step``), an adapter checkpoint of ours (its
    manifest's), a Trainer folder's ``global_step``, else None (a PEFT folder records none)."""
    found = _found(src, run)
    if found.adapter and found.format.name == "nxd":
        from .nxd.files import scan_tag
        from .nxd.step import tag_step

        return tag_step(scan_tag(Path(found.path)), verify=run.verify)
    if found.adapter and found.format.name == "peft":
        from .lora_trainer import is_trainer_folder, read_trainer_step

        return read_trainer_step(found.path) if is_trainer_folder(found.path) else None
    return int(found.manifest.step) if found.adapter and found.manifest is not None else None


def convert_adapter(
    found: str | Detected, dst: str, opts: ConvertOptions, run: RunOptions | None = None
) -> LoraResult:
    """Convert the adapter at ``found`` (a path, or what the format table detected) to ``opts.format`` (``peft`` or
    ``ckpt`` for ``--to cuda``, ``nxd`` for ``--to neuron``)."""
    run = run or RunOptions()
    found = _found(found, run)
    src = found.path
    if opts.format not in ("peft", "nxd", "ckpt", "hf-trainer", "optimum-neuron"):
        raise LayoutError(
            f"--format {opts.format}: {src} is a LoRA adapter; it converts to --format peft, ckpt or hf-trainer (--to cuda) or "
            "--format nxd or optimum-neuron (--to neuron); for a full model use --merge-lora with the base model as SRC"
        )
    want = "neuron" if opts.format in ("nxd", "optimum-neuron") else "cuda"
    if opts.to != want:
        raise LayoutError(
            f"--format {opts.format}: a LoRA adapter converts to the {want} layout there; use --to {want}"
        )
    if opts.format not in ("nxd", "optimum-neuron") and opts.layout:
        raise LayoutError(
            f"--{next(iter(opts.layout)).replace('_', '-')} describes a Neuron target; --format {opts.format} has no "
            "layout"
        )
    if opts.format == "ckpt" and found.adapter and found.format.name == "ckpt":
        raise LayoutError(
            f"--format ckpt: {src} is already an adapter checkpoint of ours (restore it directly; a copy would "
            "lose its base identity)"
        )
    adapter, src_flags = read_any(found, opts, run)
    from .lora_trainer import TRAINING_PARTS, dropped, write_trainer_folder

    notes = adapter.notes
    recorded = adapter.training.step if adapter.training is not None else None
    if opts.format == "peft":
        notes += dropped(adapter, (), "a PEFT adapter folder")
        nbytes = peft.write_adapter(adapter, dst, run.storage_options)
    elif opts.format == "hf-trainer":
        from .lora_ckpt import ckpt_step

        step = ckpt_step(src, opts.step, recorded if recorded is not None else source_step(found, run))
        nbytes = write_trainer_folder(
            adapter, dst, step=step, config=opts.config, storage_options=run.storage_options
        )
    elif opts.format == "ckpt":
        from .lora_ckpt import ckpt_step, write_ckpt_adapter

        nbytes = write_ckpt_adapter(
            adapter, dst, step=ckpt_step(src, opts.step, recorded if recorded is not None else source_step(found, run)),
            source=src, config=opts.config, storage_options=run.storage_options, codec=opts.codec,
        )  # fmt: skip
    elif opts.format == "optimum-neuron":
        from .optimum_neuron_lora import optimum_layout, write_adapter_folder

        cfg = _need_config(opts, "laying an adapter out for optimum-neuron")
        step = opts.step if opts.step is not None else recorded if recorded is not None else source_step(found, run)
        nbytes = write_adapter_folder(adapter, optimum_layout(cfg, opts.layout), dst, config=cfg, step=step,
                                      xser=opts.xser if opts.xser is not None else True)  # fmt: skip
        notes += dropped(adapter, ("scheduler", "trainer_state.json"), "an optimum-neuron LoRA checkpoint")
    else:
        cfg = _need_config(opts, "laying an adapter out for NxD")
        base = src_flags or NxdFlags()
        try:
            flags = NxdFlags(**{**{n: getattr(base, n) for n in NxdFlags.names()}, **opts.layout})
        except TypeError as e:
            raise LayoutError(f"layout flags: {e}") from None
        spec = LayoutSpec.of(ModelDims.from_hf_config(cfg), flags)
        step = opts.step if opts.step is not None else recorded if recorded is not None else source_step(found, run)
        t = adapter.training
        nbytes, notes = nxd_lora.write_lora_tag(
            adapter, spec, dst, run.storage_options, step=step, scheduler=t.scheduler if t is not None else None,
            trainer_state=t.trainer_state if t is not None else None,
        )  # fmt: skip
        notes += dropped(adapter, tuple(p for p in TRAINING_PARTS if p != "RNG state"), "an NxD LoRA tag")
        if step is None:  # said once the tag is written, so that a refusal stays one error line
            warnings.warn(
                f"{src} records no training step: the NxD LoRA tag records none either (pass --step N to set it)",
                stacklevel=2,
            )
    return LoraResult(dst, len(adapter.tensors), nbytes, opts.format, notes)


# ------------------------------------------------------------------------------------------------ merge


def merge_weights(
    base: dict[str, torch.Tensor], adapter: peft.Adapter, *, where: str = "base"
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Merge every adapted module found in ``base`` (one shard's tensors); returns the new tensors and the modules
    merged."""
    merged: set[str] = set()
    out = dict(base)
    for mod in adapter.modules:
        key = f"{mod}.weight"
        if key not in base:
            continue
        w = base[key]
        a, b = adapter.tensors[f"{mod}.lora_A.weight"], adapter.tensors[f"{mod}.lora_B.weight"]
        if tuple(w.shape) != (b.shape[0], a.shape[1]):
            raise LayoutError(
                f"{where}: {key} is {list(w.shape)} but the adapter's B @ A is {[b.shape[0], a.shape[1]]}; "
                "the adapter was trained on another base"
            )
        w = w.clone()
        w += peft_delta(a, b, adapter.scaling_of(mod))
        out[key] = w
        merged.add(mod)
    return out, merged


def peft_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * (B @ A)`` exactly as PEFT's ``lora.Linear.get_delta_weight`` (CPU): half-precision B is multiplied
    in float32 and the product cast back to B's dtype."""
    dtype = b.dtype
    cast = b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if cast:
        a, b = a.float(), b.float()
    out = (b @ a) * scaling
    return out.to(dtype=dtype) if cast else out


def merge_lora(base_src: str, dst: str, opts: ConvertOptions, run: RunOptions | None = None) -> LoraResult:
    """``base_src`` (an HF folder) + the adapter ``opts.merge_lora`` -> a full HF folder at ``dst``."""
    from safetensors.torch import load_file, save

    from ckpt.storage.folder import begin_folder

    from . import hf
    from .hf_index import hf_tensors

    run = run or RunOptions()
    assert opts.merge_lora is not None
    if opts.format != "hf" or opts.to != "cuda":
        raise LayoutError("--merge-lora writes a full Hugging Face model: use --to cuda --format hf")
    if not hf.detect(base_src):
        raise LayoutError(
            f"--merge-lora: SRC {base_src} must be the base model as an HF folder (config.json + *.safetensors)"
        )
    base = Path(base_src)
    cfg = json.loads((base / "config.json").read_text())
    opts = dataclasses.replace(opts, config=opts.config or cfg)
    adapter, _ = read_any(opts.merge_lora, opts, run)
    located = hf_tensors(base)  # the index held against the shard headers: no tensor lost or read twice
    shards = [p.name for p in dict.fromkeys(t.file for t in located.values())]
    # check every module is present with the right shape before writing anything
    seen: set[str] = set()
    for name, t in located.items():
        meta = t.entry
        if name.endswith(".weight") and name[: -len(".weight")] in adapter.modules:
            mod = name[: -len(".weight")]
            a, b = adapter.tensors[f"{mod}.lora_A.weight"], adapter.tensors[f"{mod}.lora_B.weight"]
            if tuple(meta["shape"]) != (b.shape[0], a.shape[1]):
                raise LayoutError(
                    f"{t.file}: {name} is {meta['shape']} but the adapter's B @ A is "
                    f"{[b.shape[0], a.shape[1]]}; the adapter was trained on another base"
                )
            seen.add(mod)
    missing = [m for m in adapter.modules if m not in seen]
    if missing:
        raise LayoutError(
            f"--merge-lora: {missing[0]}.weight is not in the base model {base_src} (adapter of another model?)"
        )
    nbytes = 0
    with begin_folder(dst, run.storage_options) as txn:
        for shard in shards:
            tensors, _ = merge_weights(load_file(str(base / shard)), adapter, where=str(base / shard))
            data = save(tensors, metadata={"format": "pt"})
            txn.storage.put_bytes(shard, data)
            nbytes += len(data)
        for extra in sorted(base.iterdir()):
            if extra.is_file() and extra.name not in shards and extra.name != "config.json":
                with open(extra, "rb") as f:
                    txn.storage.put_bytes(extra.name, f.read())
        txn.commit({"config.json": (base / "config.json").read_bytes()})
    return LoraResult(dst, len(adapter.modules), nbytes, "hf")


def convert(found: Detected, dst: str, opts: ConvertOptions, run: RunOptions | None = None) -> LoraResult:
    """The adapter entry's verb, run whole by ``ckpt convert``: merge into the base SRC when ``opts.merge_lora``,
    else convert the adapter SRC."""
    if opts.merge_lora is not None:
        return merge_lora(found.path, dst, opts, run)
    return convert_adapter(found, dst, opts, run)


__all__ = [
    "LoraResult",
    "convert",
    "convert_adapter",
    "detect",
    "export",
    "is_adapter",
    "merge_lora",
    "merge_weights",
    "open_source",
    "peft_delta",
    "read_any",
    "source_step",
]
