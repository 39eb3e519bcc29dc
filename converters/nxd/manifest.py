"""NxD tags <-> our Neuron-layout manifest, as library calls: thin wrappers of :func:`~ckpt.converters.convert`.

:func:`import_tag` is ``convert(tag, dest, to="neuron")`` keeping the tag's own layout (no config needed): every
rank tensor is stored as box ``tp_rank`` of its logical tensor (partition from the rule set), replicated copies are
compared and stored once, ZeRO-1 state is stored merged over DP, scheduler and ``user_content`` become the manifest's
``scheduler`` and ``user``, and ``extra.nxd`` records what the files do not say (docs/format.md).
:func:`export_tag` is ``convert(ckpt, tag, to="neuron", format="nxd")``, rank by rank (ZeRO-1 re-sharded for any DP
size, plain or xser), which NxD's ``load_checkpoint`` reads.

:func:`manifest_to_tag` and :func:`rank_shards` build the same ranks in memory (for tests and small tools).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt.format import treecodec
from ckpt.format.manifest import Manifest
from ckpt.format.reader import CheckpointReader

from ..ckpt import ManifestSource
from ..convert import convert
from ..engine import MODEL_ROLES, plan_same_layout, produce
from ..options import DEFAULT_FLUSH_BYTES, ConvertOptions, RunOptions
from .discovery import TagStatus
from .export import build_rank, rank_parts
from .naming import RankKey
from .reader import NxdTag, NxdTagMeta


def import_tag(
    tag_dir: str | Path,
    dest: str,
    *,
    allow_unmarked: bool = False,
    step: int | None = None,
    kv_size_multiplier: int | None = None,
    hw: str | None = None,
    virtual_pp: int | None = None,
    config: Mapping[str, Any] | None = None,
    param_names: Mapping[RankKey, Sequence[str]] | None = None,
    codec: str = "raw",
    flush_bytes: int = DEFAULT_FLUSH_BYTES,
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
    replicated: Sequence[str] = (),
) -> Manifest:
    """Convert one NxD tag into a checkpoint at ``dest`` keeping its layout; returns the committed manifest.

    ``step`` defaults to the number in the tag name (else ``user_content["total_steps"]``); ``hw`` /
    ``kv_size_multiplier`` / ``virtual_pp`` describe the tag where its files cannot (recorded in ``extra.nxd``);
    ``config`` (the HF ``config.json`` dict) is recorded for later conversions to other layouts; ``param_names``
    names the optimizer pids of a run with another param grouping (docs/nxd.md).  ``verify`` (default
    on) checks every NxD file's zip CRC32s; replicated copies are compared whatever ``verify`` says.  ``replicated``
    declares tensors the rule set does not know as replicated (``fnmatch`` globs); any other unknown one is refused.
    """
    given = {"kv_size_multiplier": kv_size_multiplier, "hw": hw, "virtual_pp": virtual_pp}
    opts = ConvertOptions(
        to="neuron",
        source_flags={k: v for k, v in given.items() if v is not None},
        config=dict(config) if config is not None else None,
        step=step,
        codec=codec,
        param_names=param_names,
        replicated=tuple(replicated),
    )
    run = RunOptions(
        flush_bytes=flush_bytes, storage_options=storage_options, verify=verify, allow_unmarked=allow_unmarked
    )
    convert(str(tag_dir), dest, opts, run)
    return CheckpointReader(dest, storage_options).manifest


def export_tag(
    src: str,
    root: str | Path,
    name: str,
    *,
    xser: bool | None = None,
    dp_size: int | None = None,
    zero1: bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Path:
    """Write the Neuron-layout checkpoint ``src`` as NxD-native tag ``<root>/<name>`` (``done`` last).

    ``xser`` defaults to the form the checkpoint was imported from (plain otherwise); ``dp_size`` re-shards ZeRO-1
    state (default: the saved DP size); ``zero1`` defaults to the checkpoint's ZeRO stage.
    """
    dst = str(Path(root) / name)
    opts = ConvertOptions(
        to="neuron",
        format="nxd",
        layout={"dp": dp_size} if dp_size is not None else {},
        xser=xser,
        zero1=zero1,
    )
    convert(src, dst, opts, RunOptions(storage_options=storage_options))
    return Path(dst)


def rank_shards(
    reader: CheckpointReader, *, roles: Sequence[str] = MODEL_ROLES
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """``{(tp, pp): {name: TP-local tensor}}`` of a Neuron-layout checkpoint, in memory (every rank at once)."""
    source = ManifestSource(reader.storage)
    assert source.flags is not None
    conv = plan_same_layout(source, source.flags)
    out: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for t in conv.tensors:
        if t.desc.role not in roles:
            continue
        for part in t.parts:
            data = produce(conv, part)
            for rank in part.ranks:
                out.setdefault(rank, {})[t.desc.name] = data
    return out


def manifest_to_tag(reader: CheckpointReader, *, name: str = "", dp_size: int | None = None) -> NxdTag:
    """The NxD tag (per-rank TP-local tensors, optimizers keyed by name) a Neuron-layout checkpoint stands for,
    in memory; ``ckpt convert --format nxd`` / :func:`export_tag` write the same ranks one at a time."""
    source = ManifestSource(reader.storage)
    assert source.flags is not None and source.record is not None
    flags = (
        source.flags
        if dp_size is None
        else source.record.flags(tp=source.flags.tp, pp=source.flags.pp, dp=dp_size)
    )
    conv = plan_same_layout(source, flags)
    m = reader.manifest
    zero1 = m.layout.zero_stage == 1
    per_rank_model: dict[RankKey, dict[str, torch.Tensor]] = {}
    per_rank_opt: dict[RankKey, dict[str, Any]] = {}
    for (tp, pp), parts in sorted(rank_parts(conv).items()):
        model, opt = build_rank(conv, parts)
        per_rank_model[(tp, pp, 0)] = model
        if opt is not None:
            per_rank_opt[(tp, pp, 0)] = opt
    tag_name = name or f"step_{m.step}"
    meta = NxdTagMeta(
        path=Path(tag_name), name=tag_name, step=m.step, status=TagStatus.COMPLETE, tp_size=flags.tp,
        pp_size=flags.pp, dp_size=flags.dp if zero1 else 1, ep_size=1,
        xser=bool((source.record.source or {}).get("xser", False)), zero1=zero1, legacy=False,
    )  # fmt: skip
    return NxdTag(
        meta=meta,
        per_rank_model=per_rank_model,
        per_rank_optimizer=per_rank_opt,
        scheduler=treecodec.decode(m.scheduler) if m.scheduler is not None else None,
        user_content=treecodec.decode(m.user) if m.user is not None else None,
    )


__all__ = ["export_tag", "import_tag", "manifest_to_tag", "rank_shards"]
