"""NxD-native tags <-> our Neuron-layout manifest (docs/format.md, "Neuron (NxD) layout").

:func:`import_tag` streams a tag into a checkpoint rank by rank with :class:`ckpt.writer.StreamingWriter`: memory
holds one (tp, pp) model shard, its DP-merged optimizer and the writer's flush buffer, never the whole tag.  Each
TP shard becomes box ``tp_rank`` of its logical tensor (partition from the rule set, since NxD files carry no
partition metadata); replicated tensors are stored once; ZeRO-1 state is stored merged (master weights as
``optim/<name>/master_weight``); scheduler and ``user_content`` become the manifest's ``scheduler`` and ``user``.

:func:`export_tag` goes the other way: it cuts every logical tensor back into its TP boxes, puts each on its PP
ranks (``extra.nxd.pp_ranks``, else the layout engine's pipeline rule from ``extra.nxd.config``) and writes the tag
with :func:`~.writer.write_tag` (ZeRO-1 re-sharded for any DP size, plain or xser), which NxD's
``load_checkpoint`` reads.  Export holds the tag in memory (``write_tag`` takes a whole tag).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt import treecodec
from ckpt.errors import CkptError, CorruptionError
from ckpt.manifest import Box, Layout, Manifest
from ckpt.neuron.partition import rule_partition
from ckpt.reader import CheckpointReader
from ckpt.state import optim_name
from ckpt.writer import DEFAULT_FLUSH_BYTES, StreamingWriter

from .discovery import TagStatus, tag_status
from .naming import RankKey
from .reader import NxdTag, NxdTagMeta, open_tag
from .writer import write_tag

MASTER_KEY = "master_weight"
ZERO1_TYPE = "neuronx_distributed.optimizer.zero_redundancy_optimizer.NeuronZero1Optimizer"
PLAIN_TYPE = "torch.optim.Optimizer"


def check_usable(tag_dir: str | Path, allow_unmarked: bool) -> TagStatus:
    """Refuse incomplete tags; accept unmarked ones only when asked, with a warning (NxD itself skips them)."""
    info = tag_status(tag_dir)
    if info.problems:
        raise CorruptionError(f"{info.path}: {info.status.value} tag: {info.problems[0]}")
    if info.status is TagStatus.UNMARKED:
        if not allow_unmarked:
            raise CkptError(
                f"{info.path}: tag has no 'done' marker (unmarked: crashed async save or converter output); "
                "pass allow_unmarked=True (--allow-unmarked) to use it"
            )
        warnings.warn(
            f"{info.path}: using an unmarked tag (every file present, no 'done'); NxD's auto-resume would skip it",
            stacklevel=3,
        )
    return info.status


def _partition(name: str, rule_set: str, tp: int) -> dict[str, Any] | None:
    found = rule_partition(name, rule_set)
    if found is None:
        return None
    return {"dim": found[0], "stride": found[1], "tp": tp, "source": rule_set}


def _place(shape: tuple[int, ...], part: dict[str, Any] | None, tp_rank: int) -> tuple[tuple[int, ...], Box]:
    if part is None:
        return shape, Box.full(shape)
    d, tp = part["dim"], part["tp"]
    if d >= len(shape):
        raise CkptError(f"partition dim {d} does not exist in a tensor of shape {list(shape)}")
    full = list(shape)
    full[d] *= tp
    offs = [0] * len(shape)
    offs[d] = tp_rank * shape[d]
    return tuple(full), Box(tuple(offs), shape)


def import_tag(
    tag_dir: str | Path,
    dest: str,
    *,
    allow_unmarked: bool = False,
    step: int | None = None,
    rule_set: str = "nxd-llama",
    kv_size_multiplier: int = 1,
    hw: str = "trn1",
    virtual_pp: int = 1,
    config: Mapping[str, Any] | None = None,
    param_names: Mapping[RankKey, Sequence[str]] | None = None,
    codec: str = "raw",
    flush_bytes: int = DEFAULT_FLUSH_BYTES,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Manifest:
    """Convert one NxD tag into a checkpoint at ``dest`` (a step folder); returns the committed manifest.

    ``step`` defaults to the number in the tag name (else ``user_content["total_steps"]``).  The NxD flags and
    ``config`` are recorded in ``extra.nxd`` for later conversion to the full layout (NxD files do not say them).
    """
    status = check_usable(tag_dir, allow_unmarked)
    r = open_tag(tag_dir, param_names=param_names)
    meta = r.meta
    if meta.ep_size > 1:
        raise CkptError(f"{meta.path}: expert parallelism (ep {meta.ep_size}) import is not supported")
    user = r.user_content()
    if step is None:
        step = meta.step
        if step is None and isinstance(user, dict) and isinstance(user.get("total_steps"), int):
            step = user["total_steps"]
        if step is None:
            raise CkptError(f"{meta.path}: no step in the tag name or user_content; pass step=")
    tp = meta.tp_size
    w = StreamingWriter(
        dest, codec=codec, flush_bytes=flush_bytes, overwrite=overwrite, storage_options=storage_options
    )
    try:
        stored: set[str] = set()
        pp_ranks: dict[str, list[int]] = {}
        scalars: dict[str, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        opt_extra: dict[str, Any] = {}
        optimizer_seen = False
        for rank in r.ranks:
            tp_rank, pp_rank, _ = rank
            model = r.model(rank)
            for name, t in model.items():
                pp_ranks.setdefault(name, [])
                if pp_rank not in pp_ranks[name]:
                    pp_ranks[name].append(pp_rank)
                part = _partition(name, rule_set, tp)
                if part is None and name in stored:
                    continue
                shape, box = _place(tuple(t.shape), part, tp_rank)
                w.add(name, t, shape=shape, box=box, partition=part)
                stored.add(name)
            opt = r.optimizer(rank)
            del model
            if opt is None:
                continue
            optimizer_seen = True
            tensors = {
                (name, key): v
                for name, per in opt["state"].items()
                for key, v in per.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0 and key != "step"
            }
            for name, w_ in (opt.get("master_weights") or {}).items():
                tensors[(name, MASTER_KEY)] = w_
            for (name, key), v in tensors.items():
                oname = optim_name(name, key)
                part = _partition(name, rule_set, tp)
                if part is None and oname in stored:
                    continue
                shape, box = _place(tuple(v.shape), part, tp_rank)
                w.add(
                    oname,
                    v,
                    role="optimizer_state",
                    shape=shape,
                    box=box,
                    param=name,
                    key=key,
                    partition=part,
                )
                stored.add(oname)
            for name, per in opt["state"].items():
                for key, v in per.items():
                    if (name, key) not in tensors:
                        scalars.setdefault(name, {}).setdefault(
                            key, treecodec.encode(v, f"optimizer state {name}.{key}")
                        )
            _merge_groups(groups, opt["param_groups"], where=str(meta.path))
            if opt.get("extra") and not opt_extra:
                opt_extra = treecodec.encode(opt["extra"], "optimizer extra")
        trees: dict[str, Any] = {"progress": {"step": step}}
        if optimizer_seen:
            trees["optimizer"] = {
                "type": ZERO1_TYPE if meta.zero1 else PLAIN_TYPE,
                "param_groups": groups,
                "state": scalars,
            }
        sched = r.scheduler()
        if sched is not None:
            trees["scheduler"] = treecodec.encode(sched, "scheduler.pt")
        if user is not None:
            trees["user"] = treecodec.encode(user, "user_content.pt")
        nxd: dict[str, Any] = {
            "rule_set": rule_set,
            "kv_size_multiplier": kv_size_multiplier,
            "hw": hw,
            "fuse_qkv": any(
                n.endswith(("weight_qkv", "bias_qkv")) or n.endswith("qkv_proj.weight") for n in stored
            ),
            "qkv_linear": any(".qkv_proj.weight_" in n or ".qkv_proj.bias_" in n for n in stored),
            "virtual_pp": virtual_pp,
            "config": dict(config) if config is not None else None,
            "source": {
                "format": "nxd",
                "tag": meta.name,
                "status": status.value,
                "xser": meta.xser,
                "zero1": meta.zero1,
                "legacy": meta.legacy,
            },
        }
        if meta.pp_size > 1:
            nxd["pp_ranks"] = {n: sorted(p) for n, p in pp_ranks.items()}
        if opt_extra:
            nxd["optimizer_extra"] = opt_extra
        trees["extra"] = {"nxd": nxd}
        dp = meta.dp_size
        layout = Layout(
            world_size=tp * meta.pp_size * dp, tp=tp, pp=meta.pp_size, dp=dp, ep=meta.ep_size,
            zero_stage=1 if meta.zero1 else 0, kind="nxd",
        )  # fmt: skip
        return w.commit(step=step, backend="neuron", layout=layout, trees=trees)
    except BaseException:
        w.abort()
        raise


def _merge_groups(into: list[dict[str, Any]], groups: Sequence[Mapping[str, Any]], *, where: str) -> None:
    """Union of the ranks' param groups: same hyper-parameters, parameter names in first-seen order."""
    if into and len(into) != len(groups):
        raise CorruptionError(f"{where}: ranks disagree on the number of optimizer param_groups")
    for gi, g in enumerate(groups):
        if len(into) <= gi:
            enc = {k: treecodec.encode(v, f"param_groups[{gi}].{k}") for k, v in g.items() if k != "params"}
            enc["params"] = []
            into.append(enc)
        seen = set(into[gi]["params"])
        into[gi]["params"].extend(n for n in g["params"] if n not in seen)


# ------------------------------------------------------------------------------------------------ export


def _pp_ranks(m: Manifest, names: Sequence[str]) -> dict[str, list[int]]:
    pp = m.layout.pp
    nxd = m.extra.get("nxd") or {}
    if pp == 1:
        return {n: [0] for n in names}
    saved = nxd.get("pp_ranks")
    if saved:
        missing = [n for n in names if n not in saved]
        if missing:
            raise CkptError(f"extra.nxd.pp_ranks has no PP rank for {missing[0]!r}")
        return {n: list(saved[n]) for n in names}
    config = nxd.get("config")
    if not config:
        raise CkptError(
            f"pp {pp}: the manifest has neither extra.nxd.pp_ranks nor extra.nxd.config to place tensors"
        )
    from ckpt.layouts.names import nxd_to_hf_names
    from ckpt.layouts.pipeline import pp_ranks_of
    from ckpt.layouts.spec import LayoutSpec

    spec = LayoutSpec.from_hf_config(
        treecodec.decode(config), tp=m.layout.tp, pp=pp, virtual_pp=int(nxd.get("virtual_pp", 1)),
        kv_size_multiplier=int(nxd.get("kv_size_multiplier", 1)), hw=nxd.get("hw", "trn1"),
        fuse_qkv=bool(nxd.get("fuse_qkv")), qkv_linear=bool(nxd.get("qkv_linear")),
    )  # fmt: skip
    return {n: list(pp_ranks_of(nxd_to_hf_names(n, spec)[0], spec)) for n in names}


def _tp_boxes(shape: tuple[int, ...], part: Mapping[str, Any] | None, tp: int) -> list[Box | None]:
    """Box of each TP rank (None for a replicated tensor: every rank holds all of it)."""
    if part is None:
        return [None] * tp
    d = int(part["dim"])
    if int(part.get("tp", tp)) != tp or shape[d] % tp:
        raise CorruptionError(f"partition {dict(part)} does not split shape {list(shape)} over tp {tp}")
    n = shape[d] // tp
    out: list[Box | None] = []
    for r in range(tp):
        offs = [0] * len(shape)
        lens = list(shape)
        offs[d], lens[d] = r * n, n
        out.append(Box(tuple(offs), tuple(lens)))
    return out


def rank_shards(
    reader: CheckpointReader, *, roles: Sequence[str] = ("parameter", "buffer")
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """``{(tp, pp): {name: TP-local tensor}}`` of a Neuron-layout checkpoint (what the layout engine merges)."""
    m = reader.manifest
    tp = m.layout.tp
    names = [n for n, e in m.tensors.items() if e.role in roles]
    pp_of = _pp_ranks(m, names)
    out: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for name in names:
        e = m.tensors[name]
        boxes = _tp_boxes(e.shape, e.partition, tp)
        full = reader.read(name) if boxes[0] is None else None
        for r, box in enumerate(boxes):
            t = full if box is None else _read_box(reader, name, box, e.dtype)
            for pp in pp_of[name]:
                out.setdefault((r, pp), {})[name] = t
    return out


def _read_box(reader: CheckpointReader, name: str, box: Box, dtype: str) -> torch.Tensor:
    from ckpt.dtypes import dtype_from_name

    buf = torch.empty(box.lengths, dtype=dtype_from_name(dtype))
    reader.read_box_into(name, box, buf)
    return buf


def manifest_to_tag(reader: CheckpointReader, *, name: str = "", dp_size: int | None = None) -> NxdTag:
    """The NxD tag (per-rank TP-local tensors, optimizers keyed by name) a Neuron-layout checkpoint stands for."""
    m = reader.manifest
    if m.layout.kind != "nxd":
        raise CkptError(
            f"{reader.path}: layout kind {m.layout.kind!r} is not 'nxd' (not a Neuron-layout checkpoint)"
        )
    if m.layout.ep > 1:
        raise CkptError(f"{reader.path}: expert parallelism (ep {m.layout.ep}) export is not supported")
    tp = m.layout.tp
    model = rank_shards(reader)
    per_rank_model = {(t, p, 0): sd for (t, p), sd in sorted(model.items())}
    per_rank_opt: dict[RankKey, dict[str, Any]] = {}
    nxd = m.extra.get("nxd") or {}
    if m.optimizer is not None:
        state_names = [n for n, e in m.tensors.items() if e.role == "optimizer_state"]
        pp_of = _pp_ranks(
            m, list(dict.fromkeys(m.tensors[n].param for n in state_names if m.tensors[n].param))
        )
        scalars = {
            p: {k: treecodec.decode(v) for k, v in per.items()} for p, per in m.optimizer["state"].items()
        }
        groups = [
            {k: (v if k == "params" else treecodec.decode(v)) for k, v in g.items()}
            for g in m.optimizer["param_groups"]
        ]
        extra = treecodec.decode(nxd["optimizer_extra"]) if nxd.get("optimizer_extra") else {}
        for rank_key, sd in per_rank_model.items():
            per_rank_opt[rank_key] = {
                "state": {},
                "param_groups": [{**g, "params": [n for n in g["params"] if n in sd]} for g in groups],
                "master_weights": None,
                "extra": dict(extra),
            }
        for oname in state_names:
            e = m.tensors[oname]
            assert e.param is not None and e.key is not None
            boxes = _tp_boxes(e.shape, e.partition, tp)
            full = reader.read(oname) if boxes[0] is None else None
            for r, box in enumerate(boxes):
                t = full if box is None else _read_box(reader, oname, box, e.dtype)
                for pp in pp_of[e.param]:
                    opt = per_rank_opt[(r, pp, 0)]
                    if e.key == MASTER_KEY:
                        opt["master_weights"] = opt["master_weights"] or {}
                        opt["master_weights"][e.param] = t
                    else:
                        opt["state"].setdefault(e.param, {})[e.key] = t
        for rank_key, opt in per_rank_opt.items():
            sd = per_rank_model[rank_key]
            for p, per in scalars.items():
                if p in sd:
                    opt["state"].setdefault(p, {}).update(per)
            order = [n for g in opt["param_groups"] for n in g["params"]]
            opt["state"] = {n: opt["state"][n] for n in order if n in opt["state"]}
    zero1 = m.layout.zero_stage == 1
    meta = NxdTagMeta(
        path=Path(name or f"step_{m.step}"), name=name or f"step_{m.step}", step=m.step, status=TagStatus.COMPLETE,
        tp_size=tp, pp_size=m.layout.pp, dp_size=dp_size or (m.layout.dp if zero1 else 1), ep_size=1,
        xser=bool((nxd.get("source") or {}).get("xser", False)), zero1=zero1, legacy=False,
    )  # fmt: skip
    return NxdTag(
        meta=meta,
        per_rank_model=per_rank_model,
        per_rank_optimizer=per_rank_opt,
        scheduler=treecodec.decode(m.scheduler) if m.scheduler is not None else None,
        user_content=treecodec.decode(m.user) if m.user is not None else None,
    )


def export_tag(
    src: str | CheckpointReader,
    root: str | Path,
    name: str,
    *,
    xser: bool | None = None,
    dp_size: int | None = None,
    zero1: bool | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Path:
    """Write the Neuron-layout checkpoint ``src`` as NxD-native tag ``<root>/<name>`` (``done`` last).

    ``xser`` defaults to the form the checkpoint was imported from (plain otherwise); ``dp_size`` re-shards ZeRO-1
    state (default: the saved DP size); ``zero1`` defaults to ``layout.zero_stage == 1``.
    """
    reader = src if isinstance(src, CheckpointReader) else CheckpointReader(src, storage_options)
    tag = manifest_to_tag(reader, name=name, dp_size=dp_size)
    return write_tag(
        tag, root, name, xser=tag.meta.xser if xser is None else xser, dp_size=tag.meta.dp_size,
        zero1=zero1, overwrite=overwrite,
    )  # fmt: skip
