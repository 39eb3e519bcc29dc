"""NxD-native tags <-> our Neuron-layout manifest (docs/format.md, "Neuron (NxD) layout").

:func:`import_tag` streams a tag into a checkpoint rank by rank with :class:`ckpt.writer.StreamingWriter`: memory
holds one (tp, pp) model shard, its DP-merged optimizer and the writer's flush buffer, never the whole tag.  Each
TP shard becomes box ``tp_rank`` of its logical tensor (partition from the rule set, since NxD files carry no
partition metadata); replicated tensors are stored once; ZeRO-1 state is stored merged (master weights as
``optim/<name>/master_weight``); scheduler and ``user_content`` become the manifest's ``scheduler`` and ``user``.

:func:`export_tag` goes the other way: it cuts every logical tensor back into its TP boxes, puts each on its PP
ranks (``extra.nxd.pp_ranks``, else the layout engine's pipeline rule from ``extra.nxd.config``) and writes the tag
rank by rank with :class:`~.writer.TagWriter` (ZeRO-1 re-sharded for any DP size, plain or xser), which NxD's
``load_checkpoint`` reads.  Export streams too: one (tp, pp) rank's boxes are read, written and dropped before the
next rank's are read, so memory is one rank's model shard and optimizer, whatever the model size.
:func:`manifest_to_tag` builds the same ranks into an in-memory :class:`NxdTag` (``write_tag`` of it writes the
same bytes).
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
from ckpt.layouts.partition import partition_entry
from ckpt.reader import CheckpointReader
from ckpt.state import optim_name
from ckpt.writer import DEFAULT_FLUSH_BYTES, StreamingWriter

from .discovery import TagStatus, tag_status
from .naming import RankKey
from .reader import NxdTag, NxdTagMeta, open_tag
from .writer import TagWriter

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
    verify: bool = True,
) -> Manifest:
    """Convert one NxD tag into a checkpoint at ``dest`` (a step folder); returns the committed manifest.

    ``step`` defaults to the number in the tag name (else ``user_content["total_steps"]``).  The NxD flags and
    ``config`` are recorded in ``extra.nxd`` for later conversion to the full layout (NxD files do not say them).

    ``verify`` (default on) checks the zip CRC32 of every member of each NxD file as it is read and refuses a
    damaged one with :class:`CorruptionError` before anything is committed (legacy non-zip files are not checked).
    """
    status = check_usable(tag_dir, allow_unmarked)
    r = open_tag(tag_dir, param_names=param_names, verify=verify)
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
                part = partition_entry(name, tp, rule_set)
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
                part = partition_entry(name, tp, rule_set)
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
    return {n: list(pp_ranks_of(nxd_to_hf_names(n)[0], spec)) for n in names}


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
    """``{(tp, pp): {name: TP-local tensor}}`` of a Neuron-layout checkpoint (what the layout engine merges).

    Holds every rank in memory (it is the in-memory view the tests and ``nxd_to_full_state`` use); writers go rank
    by rank (:func:`export_tag`) instead.
    """
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


def _rank_part(reader: CheckpointReader, name: str, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s part of logical tensor ``name``: its box, or the whole tensor when replicated."""
    e = reader.manifest.tensors[name]
    box = _tp_boxes(e.shape, e.partition, reader.manifest.layout.tp)[tp_rank]
    return reader.read(name) if box is None else _read_box(reader, name, box, e.dtype)


class _ExportPlan:
    """Which tensors each (tp, pp) rank of the NxD tag holds, and the optimizer trees they share (no tensor data).

    Built once from the manifest so that :meth:`rank` can read exactly one rank's boxes: the export streams rank by
    rank instead of holding the tag.  Names, orders and dict layouts are those NxD writes (model order = manifest
    order; optimizer state in param-group order; ``master_weights`` in manifest order).
    """

    def __init__(self, reader: CheckpointReader, *, name: str = "", dp_size: int | None = None) -> None:
        m = reader.manifest
        if m.layout.kind != "nxd":
            raise CkptError(
                f"{reader.path}: layout kind {m.layout.kind!r} is not 'nxd' (not a Neuron-layout checkpoint)"
            )
        if m.layout.ep > 1:
            raise CkptError(f"{reader.path}: expert parallelism (ep {m.layout.ep}) export is not supported")
        self.reader = reader
        tp = m.layout.tp
        model_names = [n for n, e in m.tensors.items() if e.role in ("parameter", "buffer")]
        pp_of = _pp_ranks(m, model_names)
        self.model: dict[tuple[int, int], list[str]] = {}
        for n in model_names:
            for r in range(tp):
                for pp in pp_of[n]:
                    self.model.setdefault((r, pp), []).append(n)
        self.has_optimizer = m.optimizer is not None
        self.state: dict[tuple[int, int], list[str]] = {}
        self.scalars: dict[str, dict[str, Any]] = {}
        self.groups: list[dict[str, Any]] = []
        nxd = m.extra.get("nxd") or {}
        self.extra = treecodec.decode(nxd["optimizer_extra"]) if nxd.get("optimizer_extra") else {}
        if m.optimizer is not None:
            state_names = [n for n, e in m.tensors.items() if e.role == "optimizer_state"]
            opp_of = _pp_ranks(
                m, list(dict.fromkeys(m.tensors[n].param for n in state_names if m.tensors[n].param))
            )
            for oname in state_names:
                e = m.tensors[oname]
                assert e.param is not None and e.key is not None
                for r in range(tp):
                    for pp in opp_of[e.param]:
                        if (r, pp) not in self.model:
                            raise CorruptionError(
                                f"{reader.path}: optimizer state {oname!r} on tp {r} pp {pp}, which holds no model tensor"
                            )
                        self.state.setdefault((r, pp), []).append(oname)
            self.scalars = {
                p: {k: treecodec.decode(v) for k, v in per.items()} for p, per in m.optimizer["state"].items()
            }
            self.groups = [
                {k: (v if k == "params" else treecodec.decode(v)) for k, v in g.items()}
                for g in m.optimizer["param_groups"]
            ]
        zero1 = m.layout.zero_stage == 1
        tag_name = name or f"step_{m.step}"
        self.meta = NxdTagMeta(
            path=Path(tag_name), name=tag_name, step=m.step, status=TagStatus.COMPLETE, tp_size=tp,
            pp_size=m.layout.pp, dp_size=dp_size or (m.layout.dp if zero1 else 1), ep_size=1,
            xser=bool((nxd.get("source") or {}).get("xser", False)), zero1=zero1, legacy=False,
        )  # fmt: skip
        self.scheduler = treecodec.decode(m.scheduler) if m.scheduler is not None else None
        self.user_content = treecodec.decode(m.user) if m.user is not None else None

    @property
    def ranks(self) -> list[RankKey]:
        return [(t, p, 0) for t, p in sorted(self.model)]

    def rank(self, key: RankKey) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """Model shard and named optimizer of rank ``key``, read from the checkpoint (only this rank's boxes)."""
        r, pp, _ = key
        sd: dict[str, torch.Tensor] = {}
        for n in self.model[(r, pp)]:
            sd[n] = _rank_part(self.reader, n, r)
        if not self.has_optimizer:
            return sd, None
        opt: dict[str, Any] = {
            "state": {},
            "param_groups": [{**g, "params": [n for n in g["params"] if n in sd]} for g in self.groups],
            "master_weights": None,
            "extra": dict(self.extra),
        }
        tensors = self.reader.manifest.tensors
        for oname in self.state.get((r, pp), []):
            e = tensors[oname]
            t = _rank_part(self.reader, oname, r)
            if e.key == MASTER_KEY:
                opt["master_weights"] = opt["master_weights"] or {}
                opt["master_weights"][e.param] = t
            else:
                opt["state"].setdefault(e.param, {})[e.key] = t
        for p, per in self.scalars.items():
            if p in sd:
                opt["state"].setdefault(p, {}).update(per)
        order = [n for g in opt["param_groups"] for n in g["params"]]
        opt["state"] = {n: opt["state"][n] for n in order if n in opt["state"]}
        return sd, opt


def _read_box(reader: CheckpointReader, name: str, box: Box, dtype: str) -> torch.Tensor:
    from ckpt.dtypes import dtype_from_name

    buf = torch.empty(box.lengths, dtype=dtype_from_name(dtype))
    reader.read_box_into(name, box, buf)
    return buf


def manifest_to_tag(reader: CheckpointReader, *, name: str = "", dp_size: int | None = None) -> NxdTag:
    """The NxD tag (per-rank TP-local tensors, optimizers keyed by name) a Neuron-layout checkpoint stands for.

    In memory (every rank at once); :func:`export_tag` writes the same tag rank by rank without holding it.
    """
    plan = _ExportPlan(reader, name=name, dp_size=dp_size)
    per_rank_model: dict[RankKey, dict[str, torch.Tensor]] = {}
    per_rank_opt: dict[RankKey, dict[str, Any]] = {}
    for key in plan.ranks:
        sd, opt = plan.rank(key)
        per_rank_model[key] = sd
        if opt is not None:
            per_rank_opt[key] = opt
    return NxdTag(
        meta=plan.meta,
        per_rank_model=per_rank_model,
        per_rank_optimizer=per_rank_opt,
        scheduler=plan.scheduler,
        user_content=plan.user_content,
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

    Streams: each (tp, pp) rank's boxes are read, written (:class:`~.writer.TagWriter`) and dropped before the next
    rank is read, so memory is one rank's model shard + optimizer (+ its ZeRO-1 shards while they are saved), not
    the tag.  Same files, byte for byte, as ``write_tag(manifest_to_tag(...))``.
    """
    reader = src if isinstance(src, CheckpointReader) else CheckpointReader(src, storage_options)
    plan = _ExportPlan(reader, name=name, dp_size=dp_size)
    meta = plan.meta
    with TagWriter(
        root, name, xser=meta.xser if xser is None else xser, dp_size=meta.dp_size,
        zero1=meta.zero1 if zero1 is None else zero1, overwrite=overwrite,
    ) as w:  # fmt: skip
        for key in plan.ranks:
            sd, opt = plan.rank(key)
            w.write_rank(key, sd, opt)
            del sd, opt
        return w.finish(plan.scheduler, plan.user_content)
