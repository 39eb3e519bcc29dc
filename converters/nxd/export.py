"""NxD-native output: a planned Neuron-layout conversion written as an NxD tag, one (tp, pp) rank at a time.

NxD stores one ``torch.save`` file per rank (and one optimizer file per DP rank of it with ZeRO-1), so a rank's model
shard plus its optimizer is the smallest unit one writer can own, and ranks are independent: they are the units of
:class:`NxdExport`.  Each rank is produced from the plan alone (:func:`build_rank`), so a rank's files are the same
bytes whoever writes it.  The coordinator's :class:`~.writer.TagWriter` opens the tag (``checkpoint`` marker),
workers add their ranks with writers that *join* it, and the coordinator writes ``scheduler.pt`` /
``user_content.pt`` and publishes it with ``done``.  Memory: one rank's state (and its ZeRO-1 shards while they are
saved), whatever the model size.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ckpt.errors import CkptError, LayoutError
from ckpt.format import treecodec
from ckpt.format.dtypes import dtype_from_name
from ckpt.layouts.names import EXPERT_STACKED
from ckpt.layouts.nxd_order import nxd_param_order

from ..engine import Conversion, OutPart, Rank, Staging, UnitReceipt, check_cover, produce
from ..engine.export import Progress
from .naming import rank_file_name
from .optim_state import MASTER_KEY
from .scratch import MIN_BYTES, Scratch
from .writer import TagWriter


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy when it is a view into a bigger storage (a slice of a source rank tensor).

    ``torch.save`` writes a view's whole storage: kept as is, rank ``r``'s file would carry every TP rank's rows of
    a dim-0-split tensor, and the rank being built would pin the whole source tensors, breaking the one-rank bound.
    """
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.contiguous().clone()
    return t


def rank_parts(conv: Conversion) -> dict[Rank, list[tuple[int, int]]]:
    """``{(tp, pp): [(tensor index, part index), ...]}``: what each target rank holds, in plan order.

    The plan is tensor-major (one logical tensor, its TP boxes, the ranks of each); NxD's files are rank-major, so
    the plan is inverted once (indices only, no data) to build one rank at a time.
    """
    out: dict[Rank, list[tuple[int, int]]] = {}
    for i, t in enumerate(conv.tensors):
        for j, part in enumerate(t.parts):
            for rank in part.ranks:
                out.setdefault(rank, []).append((i, j))
    return out


class _Keep:
    """Copies into :class:`~.scratch.Scratch` memory, one per distinct source storage while that source tensor
    lives: a part the source hands out twice (the same tensor object) stays one storage, as ``torch.save`` of the
    original would write it."""

    def __init__(self, scratch: Scratch) -> None:
        self.scratch = scratch
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        hit = self._seen.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
        out = self.scratch.copy(t)
        self._seen[key] = (weakref.ref(t), out)
        return out


class _Slots:
    """A rank tensor made of several parts along dim 0 (NxD's stacked MoE experts, one part per expert): filled
    part by part, handed out when every row is in."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, count: int, where: str) -> None:
        self.out = torch.empty(shape, dtype=dtype)
        self.left = count
        self.filled = 0
        self.where = where

    def put(self, part: OutPart, data: torch.Tensor) -> torch.Tensor | None:
        start, n = part.box.offsets[0], part.box.lengths[0]
        if tuple(data.shape) != (n, *self.out.shape[1:]):
            raise LayoutError(
                f"{self.where}: part of shape {list(data.shape)} does not fit rows {start}:{start + n} of "
                f"{list(self.out.shape)}"
            )
        self.out[start : start + n].copy_(data)
        self.filled += n
        self.left -= 1
        if self.left:
            return None
        if self.filled != self.out.shape[0]:
            raise LayoutError(f"{self.where}: parts fill {self.filled} of {self.out.shape[0]} rows")
        return self.out


def _slotted(conv: Conversion, parts: list[tuple[int, int]]) -> dict[int, _Slots]:
    """The tensors of which this rank holds several parts (stacked MoE experts, one part per expert)."""
    count: dict[int, int] = {}
    for i, _ in parts:
        count[i] = count.get(i, 0) + 1
    out = {}
    for i, n in count.items():
        if n > 1:
            d = conv.tensors[i].desc
            shape = list(d.shape)
            if d.partition is not None:
                shape[int(d.partition["dim"])] //= int(d.partition["tp"])
            out[i] = _Slots(tuple(shape), dtype_from_name(d.dtype), n, d.name)
    return out


def ep_split(
    model: dict[str, torch.Tensor], ep: int, stacked: frozenset[str] | set[str]
) -> list[dict[str, torch.Tensor]]:
    """One (tp, pp) rank's model shard -> its ``ep`` EP ranks' shards: EP rank ``k`` holds experts
    ``[k*E/ep, (k+1)*E/ep)`` of every stacked expert tensor (own copies) and every other tensor as it is."""
    if ep == 1:
        return [model]
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(ep)]
    for name, t in model.items():
        if name in stacked:
            if t.shape[0] % ep:
                raise LayoutError(f"{name}: {t.shape[0]} experts do not split over --ep {ep}")
            for k, block in enumerate(t.chunk(ep, 0)):
                out[k][name] = block.clone()
        else:
            for k in range(ep):
                out[k][name] = t
    return out


def ep_split_optimizer(
    optim: dict[str, Any] | None, ep: int, stacked: frozenset[str] | set[str]
) -> list[dict[str, Any] | None]:
    """A (tp, pp) rank's named optimizer -> its ``ep`` EP ranks' (the moments and master weights of stacked expert
    tensors split like the tensors, everything else the same on every EP rank)."""
    if optim is None or ep == 1:
        return [optim] * ep
    states = [
        ep_split(per, ep, {key for key, v in per.items() if isinstance(v, torch.Tensor) and v.dim() > 0})
        if n in stacked
        else [per] * ep
        for n, per in optim["state"].items()
    ]
    master = optim.get("master_weights")
    masters = ep_split(master, ep, stacked) if master else [master] * ep
    return [
        {
            **optim,
            "state": {n: per[k] for n, per in zip(optim["state"], states, strict=True)},
            "master_weights": masters[k],
        }
        for k in range(ep)
    ]


def build_rank(
    conv: Conversion, parts: list[tuple[int, int]], *, verify: bool = True, scratch: Scratch | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Model shard and named optimizer (``NxdTag`` form) of one target rank, produced from the plan.

    Optimizer ``state`` is in param-group order (NxD's pid order); ``param_groups`` keep the rank's parameters;
    scalar state (Adam's ``step``) and the NxD optimizer's extra keys come from the trees.  With ``scratch`` every
    large tensor is copied into file-backed memory as soon as it is made, so the rank costs page cache, not process
    memory (same values, same files).
    """
    model: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    master: dict[str, torch.Tensor] = {}
    keep = _Keep(scratch) if scratch is not None else None
    slots = _slotted(conv, parts)
    for i, j in parts:
        out = conv.tensors[i]
        d = out.desc
        if (
            i in slots
        ):  # one expert block of a stacked MoE tensor: placed in the rank's tensor, kept once complete
            data = slots[i].put(out.parts[j], produce(conv, out.parts[j], verify=verify))
            if data is None:
                continue
            if keep is not None:
                data = keep(data)
        else:
            data = produce(conv, out.parts[j], verify=verify)
            # the scratch copy is already exactly the part's bytes: no intermediate copy of a view in process memory
            data = keep(data) if keep is not None else _owned(data)
        if d.role == "optimizer_state":
            assert d.param is not None and d.key is not None
            if d.key == MASTER_KEY:
                master[d.param] = data
            else:
                states.setdefault(d.param, {})[d.key] = data
        else:
            model[d.name] = data
    assert conv.flags is not None
    rule_set = conv.record.rule_set if conv.record is not None else None
    in_order = nxd_param_order(model, rule_set, pp=conv.flags.pp)
    if in_order is not None:  # NxD loads by name; its own files list the live model's order, so ours do too
        model = {n: model[n] for n in in_order}
    opt = conv.trees.optimizer
    if opt is None:
        if states or master:
            raise CkptError(
                f"{conv.source.path}: optimizer-state tensors but no optimizer tree to write them with"
            )
        return model, None
    names = set(model)
    groups = [
        {
            **{k: treecodec.decode(v) for k, v in g.items() if k != "params"},
            "params": [p for p in g["params"] if p in names],
        }
        for g in opt.get("param_groups", [])
    ]
    for p, per in opt.get("state", {}).items():
        if p in names:
            states.setdefault(p, {}).update({k: treecodec.decode(v) for k, v in per.items()})
    groups = _nxd_ordered(conv, groups)
    order = [n for g in groups for n in g["params"]]
    extra = conv.record.optimizer_extra if conv.record is not None else None
    return model, {
        "state": {n: states[n] for n in order if n in states},
        "param_groups": groups,
        "master_weights": {n: master[n] for n in order if n in master} or None,
        "extra": dict(treecodec.decode(extra)) if extra is not None else {},
    }


def _nxd_ordered(conv: Conversion, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each param group's names in the order NxD's live model lists them, so that NxD's positional
    ``optimizer.load_state_dict`` puts every moment on its own parameter (:mod:`ckpt.layouts.nxd_order`).

    Where that order is not known: an NxD tag with the same pipeline size keeps its groups' order (the order of
    the NxD optimizer that saved them, which its reader named from ``param_names`` or NxD's own model files); a
    single group keeps the source's order, as before; several groups from anything else (an HF Trainer, or one of
    our Neuron-layout checkpoints, which may have been converted from CUDA) are refused, never guessed.
    """
    f = conv.flags
    assert f is not None
    rule_set = conv.record.rule_set if conv.record is not None else None
    ordered = [nxd_param_order(g["params"], rule_set, pp=f.pp) for g in groups]
    if all(o is not None for o in ordered):
        return [{**g, "params": o} for g, o in zip(groups, ordered, strict=True)]
    src = conv.source
    if len(groups) <= 1 or (src.format in ("nxd", "nxdt") and src.flags is not None and src.flags.pp == f.pp):
        return groups
    raise LayoutError(
        f"{src.path}: an optimizer with {len(groups)} param groups cannot be written as an NxD tag of rule set "
        f"{rule_set} with pp={f.pp}: NxD loads optimizer state by position and ckpt does not know NxD's parameter "
        "order for this layout; write --format ckpt --to neuron instead"
    )


class NxdExport:
    """An NxD tag as an :class:`~converters.engine.Export`: one unit = one (tp, pp) rank."""

    def __init__(
        self,
        conv: Conversion,
        *,
        xser: bool | None = None,
        zero1: bool | None = None,
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
    ) -> None:
        if conv.to != "neuron" or conv.flags is None:
            raise LayoutError("--format nxd holds the Neuron layout; use --to neuron")
        self.conv = conv
        source = (conv.record.source or {}) if conv.record is not None else {}
        self.xser = bool(source.get("xser", False)) if xser is None else xser
        self.zero1 = conv.zero1 if zero1 is None else zero1
        self.dp_size = conv.flags.dp if self.zero1 else 1
        self.ep = conv.flags.ep
        self.stacked = frozenset(t.desc.name for t in conv.tensors if EXPERT_STACKED.match(t.desc.name))
        if self.ep > 1 and self.zero1 and conv.trees.optimizer is not None and self.dp_size % self.ep:
            raise LayoutError(
                f"--format nxd: ZeRO-1 with expert parallelism needs --dp ({self.dp_size}) a multiple of --ep "
                f"({self.ep}); NxD's expert data parallel size is dp/ep"
            )
        self.storage_options = storage_options
        self.verify = verify
        opt = conv.trees.optimizer
        if opt is not None:  # an optimizer NxD could not load is refused before anything is written
            _nxd_ordered(conv, [{"params": list(g["params"])} for g in opt.get("param_groups", [])])
        by_rank = rank_parts(conv)
        self.ranks = sorted(by_rank)
        self.parts = [by_rank[r] for r in self.ranks]

        def nbytes(i: int, j: int) -> int:
            return conv.tensors[i].parts[j].nbytes

        #: bytes each rank writes (replicated tensors on every rank holding them): what the workers balance
        self.weights = [sum(nbytes(i, j) for i, j in parts) for parts in self.parts]
        # progress counts a replicated part on its first rank only, so the ranks add up to ``conv.nbytes``
        self._logical = [
            sum(nbytes(i, j) for i, j in parts if conv.tensors[i].parts[j].ranks[0] == self.ranks[u])
            for u, parts in enumerate(self.parts)
        ]
        self._writer: TagWriter | None = None

    def unit_parts(self, unit: int) -> list[OutPart]:
        """The parts target rank ``unit`` holds (what torchrun ranks plan their reads by)."""
        return [self.conv.tensors[i].parts[j] for i, j in self.parts[unit]]

    def held_bytes(self, retained: Callable[[OutPart], int]) -> int:
        """A target rank is built whole before its files are written (NxD's file unit), but its tensors and ZeRO-1
        shards live in file-backed :class:`~.scratch.Scratch` memory: what stays in process memory is the tensors
        under ``MIN_BYTES`` (none by default) and their shards; the part being copied in counts in its own cost."""
        worst = 0
        for parts in self.parts:
            small = 0
            for i, j in parts:
                part = self.conv.tensors[i].parts[j]
                if part.nbytes < MIN_BYTES:
                    small += part.nbytes
                    if self.zero1 and self.conv.tensors[i].desc.role == "optimizer_state":
                        small += part.nbytes
            worst = max(worst, small)
        return worst

    def _tag_writer(self, dst: str, join: str | None = None) -> TagWriter:
        return TagWriter(
            dst, xser=self.xser, dp_size=self.dp_size, zero1=self.zero1, ep_size=self.ep,
            storage_options=self.storage_options, join=join, expert_tensors=self.stacked,
        )  # fmt: skip

    def begin(self, dst: str) -> Staging:
        self._writer = self._tag_writer(dst)
        return Staging(self._writer.url, "")

    def write(
        self, staging: Staging, units: Sequence[int], progress: Progress = None, *, worker: int = 0
    ) -> UnitReceipt:
        """Build and write ranks ``units`` one at a time into the coordinator's tag."""
        w = self._tag_writer(staging.url, join=staging.url)
        try:
            for u in units:
                tp, pp = self.ranks[u]
                with Scratch() as scratch:
                    model, optim = build_rank(self.conv, self.parts[u], verify=self.verify, scratch=scratch)
                    for k, (shard, opt) in enumerate(
                        zip(
                            ep_split(model, self.ep, self.stacked),
                            ep_split_optimizer(optim, self.ep, self.stacked),
                            strict=True,
                        )
                    ):
                        w.write_rank((tp, pp, k), shard, opt, empty=scratch.empty)
                    del model, optim, shard, opt
                if progress is not None:
                    progress(self._logical[u])
        finally:
            w.abort()  # a joined writer only stops; the tag is the coordinator's
        return UnitReceipt(worker, tuple(units), [self.ranks[u] for u in units])

    def commit(self, staging: Staging, dst: str, receipts: list[UnitReceipt]) -> str:
        """Check every rank's model file is there, then ``scheduler.pt`` / ``user_content.pt`` and ``done``."""
        check_cover(receipts, len(self.ranks), dst)
        if self._writer is None or self._writer.url != staging.url:
            raise CkptError(f"{dst}: commit by a writer that did not begin this tag")
        for tp, pp in self.ranks:
            for k in range(self.ep):
                if not self._writer.storage.exists(
                    f"model/{rank_file_name(0, tp, pp, k if self.ep > 1 else None)}"
                ):
                    raise CkptError(f"{dst}: rank tp {tp} pp {pp} ep {k} was not written")
        self._writer.finish(*self.closing_files())
        return dst

    def closing_files(self) -> tuple[Any, Any]:
        """The objects of ``scheduler.pt`` and ``user_content.pt`` (None: not written), saved at the commit."""
        trees = self.conv.trees
        return (
            treecodec.decode(trees.scheduler) if trees.scheduler is not None else None,
            treecodec.decode(trees.user) if trees.user is not None else None,
        )

    def abort(self, staging: Staging) -> None:
        if self._writer is not None:
            self._writer.abort()


def export(conv: Conversion, *, xser: bool | None = None, zero1: bool | None = None,
           storage_options: dict[str, Any] | None = None, verify: bool = True, **_: Any) -> NxdExport:  # fmt: skip
    return NxdExport(conv, xser=xser, zero1=zero1, storage_options=storage_options, verify=verify)


__all__ = ["NxdExport", "build_rank", "ep_split", "ep_split_optimizer", "export", "rank_parts"]
