"""NxD LoRA adapter tags: what ``nxd.save_checkpoint`` writes for a ``LoraModel`` with ``merge_sharded_lora=False``.

Each ``model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt`` holds that rank's shards of the LoRA matrices under NxD's module
names (``...qkv_proj.lora_A.weight``, ``...qkv_proj.lora_B.weight_q``, ``...gate_up_proj.lora_B.weight``; layout in
:mod:`ckpt.layouts.lora`), plus ``lora_config`` (the ``LoraConfig.selected_fields_to_save()`` dict) when saved with
``save_lora_config_adapter=True``; otherwise NxD writes the same dict as ``adapter_config.json`` into
``lora_save_dir`` (the tag's parent, for ``load_checkpoint``).

The adapter's optimizer state, when the source has it, is written as NxD's ``optim/`` rank files (plain, or with
``--dp N`` ZeRO-1 shards, one file per DP rank) and read back from them (:mod:`converters.lora_optim`).

What ckpt writes: the rank files with ``lora_config`` inside (so NxD's ``LoraModel.load_checkpoint`` needs no other
file), ``adapter_config.json`` in the tag too (NxD's fields, plus ``peft_config``: the PEFT config it came from, so
that a round trip gives the same PEFT folder, ``ckpt_layout``: the parallel flags, and ``ckpt_trainer_state`` when it came from a Trainer folder, ``ckpt_widened`` when the
adapter was widened to fit NxD's fused layers, :mod:`converters.lora_widen`), ``checkpoint`` and ``done``.

Refused on read: NxD's default ``merge_sharded_lora=True`` form (every rank holds gathered tensors; for
``GQAQKVColumnParallelLinear`` NxD also truncates them with ``chunk(kv_size_multiplier)[0]``, losing query rows) is
detected by its shapes and named; base weights in the tag (``save_lora_base=True``) are refused too.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CkptError, LayoutError
from ckpt.layouts.lora import NXD_LORA, adapter_to_nxd, is_lora_name, nxd_to_adapter
from ckpt.layouts.spec import LayoutSpec, NxdFlags

from ..peft import Adapter, check_config
from .files import scan_tag
from .flags import kv_multiplier
from .naming import rank_file_name
from .source import check_usable
from .xser import can_mmap, load_checked, load_nxd_file, save_nxd_file

CONFIG_NAME = "adapter_config.json"
LORA_CONFIG_KEY = "lora_config"
#: the Trainer state of a tag written from a Trainer folder (in the tag's adapter_config.json, beside peft_config)
TRAINER_STATE_KEY = "ckpt_trainer_state"
#: NxD LoraConfig.get_selected_fields() (+ "r", which selected_fields_to_save adds for PEFT compatibility)
NXD_FIELDS = (
    "bias", "init_lora_weights", "lora_alpha", "lora_dropout", "lora_rank", "use_rslora", "target_modules",
    "modules_to_save", "save_lora_base", "merge_lora", "save_lora_config_adapter", "r",
)  # fmt: skip


def _peek(path: Path, xser: bool) -> dict[str, Any]:
    """The top-level keys' objects of one rank file, cheaply: memory-mapped (plain) or the xser ref file alone (its
    tensors stay references; no tensor file is read)."""
    obj = load_checked(path, verify=False, mmap=not xser and can_mmap(path))
    return obj if isinstance(obj, dict) else {}


def is_lora_tag(path: str) -> bool:
    """True when ``path`` is an NxD tag whose model files hold LoRA matrices only (one rank file is peeked at)."""
    p = Path(path)
    if "://" in path or not p.is_dir():
        return False
    cfg = p / CONFIG_NAME
    if cfg.is_file():
        try:
            return "lora_rank" in json.loads(cfg.read_text())
        except ValueError:
            return False
    try:
        files = scan_tag(p)
    except CkptError:
        return False
    if not files.model:
        return False
    keys = [k for k in _peek(files.model[min(files.model)], files.xser) if k != LORA_CONFIG_KEY]
    return bool(keys) and all(is_lora_name(k) for k in keys)


def _nxd_config(tag: Path, rank_files: Mapping[Any, dict[str, Any]]) -> dict[str, Any]:
    for cand in (tag / CONFIG_NAME, tag.parent / CONFIG_NAME):
        if cand.is_file():
            try:
                cfg = json.loads(cand.read_text())
            except ValueError as e:
                raise CkptError(f"{cand}: not valid JSON ({e})") from None
            if isinstance(cfg, dict) and "lora_rank" in cfg:
                return cfg
    for sd in rank_files.values():
        if isinstance(sd.get(LORA_CONFIG_KEY), dict):
            return dict(sd[LORA_CONFIG_KEY])
    raise CkptError(
        f"{tag}: no LoRA config: expected lora_config in the rank files (save_lora_config_adapter=True) or "
        f"{CONFIG_NAME} in the tag or its parent (NxD's lora_save_dir)"
    )


def _flags(names: list[str], shapes: dict[str, tuple[int, ...]], config: Mapping[str, Any], tp: int, pp: int,
           source_flags: Mapping[str, Any]) -> NxdFlags:  # fmt: skip
    qkv_linear = any(n.endswith(("qkv_proj.lora_B.weight_q", "qkv_proj.lora_B.weight_qkv")) for n in names)
    fuse_qkv = any(n.endswith(("qkv_proj.lora_B.weight_qkv", "qkv_proj.lora_B.weight")) for n in names)
    base_names = [n.replace(".lora_B.", ".") for n in names]
    base_shapes = {n.replace(".lora_B.", "."): s for n, s in shapes.items()}
    mult = source_flags.get("kv_size_multiplier") or (
        kv_multiplier(base_names, base_shapes, config, tp) if qkv_linear else 1
    )
    return NxdFlags(
        tp=tp, pp=pp, virtual_pp=source_flags.get("virtual_pp", 1), kv_size_multiplier=mult,
        hw=source_flags.get("hw", "trn1"), qkv_linear=qkv_linear, fuse_qkv=fuse_qkv,
    )  # fmt: skip


def read_lora_tag(
    path: str,
    *,
    config: Mapping[str, Any],
    source_flags: Mapping[str, Any] | None = None,
    allow_unmarked: bool = False,
    verify: bool = True,
) -> tuple[Adapter, LayoutSpec]:
    """The adapter (HF names, full tensors) in an NxD LoRA tag, and the layout it was stored in."""
    tag = Path(path)
    check_usable(tag, allow_unmarked)
    files = scan_tag(tag)
    if files.legacy or not files.model:
        raise CkptError(f"{tag}: no model/dp_rank_*_tp_rank_*_pp_rank_*.pt rank files")
    if files.ep_size > 1:
        raise LayoutError(f"{tag}: expert-parallel LoRA tags are not supported")
    raw: dict[tuple[int, int], dict[str, Any]] = {}
    for key, f in sorted(files.model.items()):
        obj = load_nxd_file(f, files.xser, verify=verify, context=f"tp rank {key[0]}, pp rank {key[1]}")
        if not isinstance(obj, dict):
            raise CkptError(f"{f}: expected a dict of tensors, got {type(obj).__name__}")
        raw[(key[0], key[1])] = obj
    nxd_cfg = _nxd_config(tag, raw)
    shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for rank, obj in raw.items():
        for name, t in obj.items():
            if name == LORA_CONFIG_KEY:
                continue
            if not isinstance(t, torch.Tensor) or NXD_LORA.match(name) is None:
                raise LayoutError(
                    f"{files.model[(*rank, 0)]}: {name} is not an NxD LoRA tensor (a tag saved with "
                    "save_lora_base=True or merge_lora=True holds base weights; convert those with the model path)"
                )
            shards.setdefault(rank, {})[name] = t
    names = sorted({n for sd in shards.values() for n in sd})
    shapes = {n: tuple(sd[n].shape) for sd in shards.values() for n in sd}
    flags = _flags(names, shapes, config, files.tp_size, files.pp_size, source_flags or {})
    spec = LayoutSpec.of(_dims(config), flags)
    try:
        tensors = nxd_to_adapter(shards, spec)
    except LayoutError as e:
        if files.tp_size > 1 and _looks_gathered(shards):
            raise LayoutError(
                f"{tag}: every rank holds the same LoRA tensors; this looks like NxD's merge_sharded_lora=True save "
                "(gathered, and truncated for GQAQKV layers), which cannot be converted exactly; save with "
                f"merge_sharded_lora=False ({e})"
            ) from None
        raise
    peft_cfg = nxd_cfg.get("peft_config") or {}
    if peft_cfg:
        check_config(peft_cfg, f"{tag}/{CONFIG_NAME} peft_config")
    for key, ok in (("bias", "none"), ("modules_to_save", None)):
        if nxd_cfg.get(key, ok) not in (ok, None, []):
            raise LayoutError(f"{tag}: LoRA config {key}={nxd_cfg[key]!r} is not supported (expected {ok!r})")
    optimizer = None
    if files.optim:
        from ..lora_optim import from_nxd, from_zero1
        from .zero1 import is_zero1_dict

        by_rank: dict[tuple[int, int], list[Any]] = {}
        for (_dp, key), f in sorted(files.optim.items()):
            by_rank.setdefault((key[0], key[1]), []).append(
                load_nxd_file(f, files.xser, verify=verify, context=f"optimizer dp {_dp} tp {key[0]}")
            )
        optims = {}
        for rank, dicts in by_rank.items():
            if any(is_zero1_dict(d) for d in dicts):
                optims[rank] = from_zero1(
                    dicts, shards.get(rank, {}), f"{tag}: ZeRO-1 optim tp {rank[0]} pp {rank[1]}"
                )
            elif len(dicts) > 1:
                raise LayoutError(f"{tag}: {len(dicts)} DP ranks of plain (not ZeRO-1) LoRA optimizer files")
            else:
                optims[rank] = dicts[0]
        optimizer = from_nxd(optims, shards, spec, tensors, str(tag))
    training = None
    trainer_state = nxd_cfg.get(TRAINER_STATE_KEY)
    if files.scheduler is not None or isinstance(trainer_state, dict):  # written from a Trainer folder
        from ..peft import Training
        from .step import tag_step

        step = tag_step(files, verify=verify, warn=False)
        if step is not None:
            sched = load_checked(files.scheduler, verify=verify) if files.scheduler is not None else None
            training = Training(
                step, sched, {}, dict(trainer_state) if isinstance(trainer_state, dict) else {}
            )
    adapter = Adapter(
        training=training,
        optimizer=optimizer,
        tensors=tensors,
        r=int(nxd_cfg.get("lora_rank", nxd_cfg.get("r", 0))),
        lora_alpha=nxd_cfg["lora_alpha"],
        use_rslora=bool(nxd_cfg.get("use_rslora", False)),
        lora_dropout=float(nxd_cfg.get("lora_dropout") or 0.0),
        peft_config=peft_cfg,
    )
    from ..lora_widen import RECORD_KEY, narrow

    if isinstance(nxd_cfg.get(RECORD_KEY), dict):
        adapter = narrow(adapter, nxd_cfg[RECORD_KEY], str(tag))
    return adapter, spec


def _looks_gathered(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]]) -> bool:
    by_pp: dict[int, list[Mapping[str, torch.Tensor]]] = {}
    for (_, pp), sd in shards.items():
        by_pp.setdefault(pp, []).append(sd)
    for group in by_pp.values():
        first = group[0]
        for sd in group[1:]:
            if set(sd) != set(first) or any(sd[n].shape != first[n].shape for n in sd):
                return False
    return any(".lora_B." in n and not n.endswith("o_proj.lora_B.weight") and not n.endswith("down_proj.lora_B.weight")
               for g in by_pp.values() for n in g[0])  # fmt: skip


def _dims(config: Mapping[str, Any]) -> Any:
    from ckpt.layouts.spec import ModelDims

    return ModelDims.from_hf_config(config)


def nxd_lora_config(
    adapter: Adapter, shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]]
) -> dict[str, Any]:
    """NxD ``LoraConfig.selected_fields_to_save()`` for ``adapter`` (target modules in NxD's module names)."""
    targets = sorted({NXD_LORA.match(n)["mod"].rsplit(".", 1)[-1] for sd in shards.values() for n in sd})  # type: ignore[index]
    return {
        "bias": "none",
        "init_lora_weights": "default",
        "lora_alpha": adapter.lora_alpha,
        "lora_dropout": adapter.lora_dropout,
        "lora_rank": adapter.r,
        "use_rslora": adapter.use_rslora,
        "target_modules": targets,
        "modules_to_save": None,
        "save_lora_base": False,
        "merge_lora": False,
        "save_lora_config_adapter": True,
        "r": adapter.r,
    }


def check_every_layer(adapter: Adapter, layers: int) -> None:
    """NxD's ``LoraModel`` adapts a target module in every layer (its ``target_modules`` are module names), and loads
    the adapter with missing keys refused: an adapter must cover the same modules in every layer."""
    per_layer: dict[int, set[str]] = {i: set() for i in range(layers)}
    for name in adapter.tensors:
        parts = name.split(".")
        if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and int(parts[2]) in per_layer:
            per_layer[int(parts[2])].add(".".join(parts[3:]))
    first = per_layer[0]
    for i, names in per_layer.items():
        if names != first:
            odd = sorted(names ^ first)[0]
            has, lacks = (i, 0) if odd in names else (0, i)
            raise LayoutError(
                f"model.layers.{lacks} has no {odd} while model.layers.{has} has: NxD's LoraModel adapts its target "
                "modules in every layer and refuses missing keys, so this adapter cannot be loaded by NxD"
            )


def write_lora_tag(
    adapter: Adapter,
    spec: LayoutSpec,
    dst: str,
    storage_options: dict[str, Any] | None = None,
    *,
    step: int | None = None,
    scheduler: Any = None,
    trainer_state: dict[str, Any] | None = None,
) -> tuple[int, tuple[str, ...]]:
    """Write ``adapter`` as an NxD LoRA tag in layout ``spec`` at ``dst`` (checked fully before any byte is
    written; published whole with ``done`` last), widened where NxD's fused layers need it.  ``step`` (None: not
    known) goes into ``user_content.pt`` as ``total_steps``, where NxD training scripts keep it and the tag's
    readers look first; ``scheduler`` (a state dict) goes into ``scheduler.pt``, where ``nxd.save_checkpoint``
    puts it; ``trainer_state`` (a Trainer folder's ``trainer_state.json``) into ``adapter_config.json`` as
    ``ckpt_trainer_state``, so that the tag converts back to a Trainer folder that resumes.  Returns the bytes of tensor data written and the summary lines (the widening, when there
    was one)."""
    from ckpt.storage.folder import begin_folder

    from ..lora_optim import to_nxd, to_zero1
    from ..lora_widen import RECORD_KEY, widen

    check_every_layer(adapter, spec.model.layers)
    original = adapter
    adapter, record = widen(adapter, spec)
    shards = adapter_to_nxd(adapter.tensors, spec)
    optims = to_nxd(adapter.optimizer, adapter.tensors, spec, shards) if adapter.optimizer else {}
    lora_cfg = nxd_lora_config(adapter, shards)
    tag_cfg = {
        **lora_cfg,
        "peft_config": original.to_peft_config(),
        "ckpt_layout": {n: getattr(spec, n) for n in NxdFlags.names() if n != "dp"},
    }
    if record is not None:
        tag_cfg[RECORD_KEY] = record
    if trainer_state:
        tag_cfg[TRAINER_STATE_KEY] = trainer_state
    nbytes = 0
    with begin_folder(dst, storage_options) as txn:
        txn.storage.put_bytes("checkpoint", b"1")
        for tp, pp in spec.ranks:
            sd: dict[str, Any] = dict(shards.get((tp, pp), {}))
            nbytes += sum(t.numel() * t.element_size() for t in sd.values())
            sd[LORA_CONFIG_KEY] = lora_cfg
            save_nxd_file(sd, txn.storage, f"model/{rank_file_name(0, tp, pp)}", False)
            if optims and spec.dp > 1:  # ZeRO-1: one file of shards per DP rank
                where = f"{dst} optim tp {tp} pp {pp}"
                for dp, od in enumerate(to_zero1(optims[(tp, pp)], shards.get((tp, pp), {}), spec.dp, where)):
                    save_nxd_file(od, txn.storage, f"optim/{rank_file_name(dp, tp, pp)}", False)
            elif optims:
                save_nxd_file(optims[(tp, pp)], txn.storage, f"optim/{rank_file_name(0, tp, pp)}", False)
        txn.storage.put_bytes(CONFIG_NAME, (json.dumps(tag_cfg, indent=2, sort_keys=True) + "\n").encode())
        if step is not None:
            save_nxd_file({"total_steps": int(step)}, txn.storage, "user_content.pt", False)
        if scheduler is not None:
            save_nxd_file(scheduler, txn.storage, "scheduler.pt", False)
        txn.commit({"done": b"1"})
    if not shards:
        warnings.warn(f"{dst}: the adapter laid out to no tensors", stacklevel=2)
    from ..lora_widen import widen_note

    return nbytes, ((widen_note(record),) if record is not None else ())


__all__ = ["CONFIG_NAME", "is_lora_tag", "nxd_lora_config", "read_lora_tag", "write_lora_tag"]
