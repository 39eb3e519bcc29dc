"""Frozen plans: for every target tensor, which slices of which source tensors it is made of.

Planning touches no tensor data: it needs only names, shapes and dtypes (a safetensors header, or the
metadata of NxD rank files), so it is cheap, testable on its own, and lets a streaming converter execute
one target tensor at a time with memory bounded by that tensor and its sources (``execute.py``).

The single source of truth is :func:`placements`: where each piece of one Hugging Face tensor lives in the
NxD layout.  Both directions are derived from it, so full->NxD->full is an exact inverse by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from ckpt.errors import LayoutError
from ckpt.layouts import gqa
from ckpt.layouts.fused import local_part_sizes, part_offsets
from ckpt.layouts.names import hf_to_nxd_name, nxd_to_hf_names
from ckpt.layouts.pipeline import layer_index, pp_ranks_of
from ckpt.layouts.rules import Kind, Rule, check_known, rule_for
from ckpt.layouts.spec import LayoutSpec, ModelDims
from ckpt.layouts.tp import runs, strided_ranges

H = TypeVar("H")
W = TypeVar("W")

Rank = tuple[int, int]
"""``(tp_rank, pp_rank)``; NxD model files are ``dp_rank_00_tp_rank_TT_pp_rank_PP.pt``."""


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor, without its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class Placement:
    """Rows/cols ``[hf_start, hf_start+length)`` of HF tensor ``hf_name`` along ``dim`` are stored at
    ``[nxd_start, nxd_start+length)`` of ``nxd_name`` on ``rank``.  ``dim=None``: the whole tensor.
    ``replica`` 0 is the canonical copy read when merging; other values are identical copies
    (KV replication, TP-replicated norms, PP-replicated buffers)."""

    hf_name: str
    rank: Rank
    nxd_name: str
    dim: int | None
    hf_start: int
    nxd_start: int
    length: int
    replica: int = 0


@dataclass(frozen=True)
class Piece:
    """A slice of one source tensor: ``[start, start+length)`` along ``dim`` (``dim=None``: all of it).
    ``rank`` is ``None`` when the source is the full (HF) layout."""

    name: str
    rank: Rank | None
    dim: int | None
    start: int = 0
    length: int = 0


@dataclass(frozen=True)
class TensorPlan:
    """One target tensor: the concatenation of ``pieces`` along ``dim`` (or the single piece if ``dim`` is
    ``None``).  ``replicas`` are alternative piece lists that must give the same bits (checked on request)."""

    name: str
    rank: Rank | None
    meta: TensorMeta
    dim: int | None
    pieces: tuple[Piece, ...]
    replicas: tuple[tuple[Piece, ...], ...] = ()
    transpose: bool = False
    """Deliver the assembled ``[rows, cols]`` tensor as ``[1, cols, rows]``: one MoE expert's slot of NxD's stacked
    expert tensor (``converters/engine/experts.py``); ``meta`` is the assembled (untransposed) tensor's."""

    @property
    def sources(self) -> tuple[tuple[Rank | None, str], ...]:
        """Distinct ``(rank, name)`` source tensors of the canonical pieces, in first-use order."""
        return tuple(dict.fromkeys((p.rank, p.name) for p in self.pieces))


@dataclass(frozen=True)
class LayoutPlan:
    """All target tensors of one conversion."""

    spec: LayoutSpec
    direction: Literal["full_to_nxd", "nxd_to_full"]
    tensors: tuple[TensorPlan, ...]

    def for_rank(self, rank: Rank | None) -> tuple[TensorPlan, ...]:
        return tuple(t for t in self.tensors if t.rank == rank)

    def get(self, name: str, rank: Rank | None = None) -> TensorPlan:
        for t in self.tensors:
            if t.name == name and t.rank == rank:
                return t
        raise KeyError((name, rank))

    @property
    def ranks(self) -> tuple[Rank | None, ...]:
        return tuple(dict.fromkeys(t.rank for t in self.tensors))


# --------------------------------------------------------------------------------------------- placements


def _segments(spec: LayoutSpec, rule: Rule, shape: tuple[int, ...], tp: int) -> list[tuple[int, int, int]]:
    """``(hf_start, length, copy)`` segments of an HF tensor that TP rank ``tp`` holds, in stored order."""
    hd = spec.model.head_dim
    kind = rule.kind
    if kind is Kind.REPLICATED:
        return [(0, 0, tp)]
    if kind in (Kind.VOCAB, Kind.GATE_UP, Kind.ROW):
        dim = rule.partition_dim or 0
        return [(s, n, 0) for s, n in strided_ranges(shape[dim], spec.tp, tp)]
    if kind in (Kind.ATTN_Q, Kind.ATTN_O):
        return [(h * hd, n * hd, 0) for h, n in runs(gqa.q_heads_of_rank(spec, tp))]
    if kind is Kind.ATTN_KV:
        segs: list[tuple[int, int, int]] = []
        for head, copy in gqa.kv_slots_of_rank(spec, tp):
            last = segs[-1] if segs else None
            if last and last[2] == copy and last[0] + last[1] == head * hd:
                segs[-1] = (last[0], last[1] + hd, copy)
            else:
                segs.append((head * hd, hd, copy))
        return segs
    raise AssertionError(kind)


def expected_full_shape(hf_name: str, spec: LayoutSpec, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Shape the config implies for HF tensor ``hf_name`` (``None``: the config says nothing about it)."""
    m: ModelDims = spec.model
    kind = rule_for(hf_name, spec.rules, spec.rule_set).kind
    rows = {Kind.ATTN_Q: m.q_rows, Kind.ATTN_KV: m.kv_rows, Kind.GATE_UP: m.intermediate}.get(kind)
    if rows is not None:
        return (rows, m.hidden) if hf_name.endswith(".weight") else (rows,)
    if kind is Kind.ATTN_O:
        return (m.hidden, m.q_rows)
    if kind is Kind.ROW:
        return (m.hidden, m.intermediate)
    if kind is Kind.VOCAB:
        return (shape[0], m.hidden) if len(shape) == 2 else None
    return None


def placements(spec: LayoutSpec, hf_name: str, shape: tuple[int, ...]) -> tuple[Placement, ...]:
    """Where every piece of HF tensor ``hf_name`` (of full shape ``shape``) lives in the NxD layout."""
    shape = tuple(shape)
    expected = expected_full_shape(hf_name, spec, shape)
    if expected is not None and shape != expected:
        raise LayoutError(f"{hf_name} has shape {list(shape)} but the config implies {list(expected)}")
    rule = rule_for(hf_name, spec.rules, spec.rule_set)
    nxd_name = hf_to_nxd_name(hf_name, spec)
    parts = nxd_to_hf_names(nxd_name, spec.family)
    base = 0
    if len(parts) > 1:
        base = part_offsets(local_part_sizes(parts, spec))[parts.index(hf_name)]
    dim = rule.partition_dim
    out = []
    for i, pp in enumerate(pp_ranks_of(hf_name, spec)):
        for tp in range(spec.tp):
            offset = base
            for start, length, copy in _segments(spec, rule, shape, tp):
                out.append(
                    Placement(hf_name, (tp, pp), nxd_name, dim, start, offset, length, i * spec.tp + copy)
                )
                offset += length
    return tuple(out)


# --------------------------------------------------------------------------------------------- full -> NxD


def plan_full_to_nxd(spec: LayoutSpec, full_metas: Mapping[str, TensorMeta]) -> LayoutPlan:
    """Plan every NxD rank tensor from the full (HF-named) tensors described by ``full_metas``.

    Raises ``LayoutError`` if a fused NxD tensor lacks one of its parts (e.g. ``up_proj`` without
    ``gate_proj``), if parts of one fused tensor disagree in dtype, or if a shape contradicts the config.
    """
    check_known(full_metas, spec.rules, spec.rule_set)
    grouped: dict[tuple[Rank, str], list[Placement]] = {}
    for name, meta in full_metas.items():
        for p in placements(spec, name, meta.shape):
            grouped.setdefault((p.rank, p.nxd_name), []).append(p)
    order = {r: i for i, r in enumerate(spec.ranks)}
    plans = []
    for (rank, nxd_name), ps in sorted(grouped.items(), key=lambda kv: order[kv[0][0]]):
        parts = nxd_to_hf_names(nxd_name, spec.family)
        missing = [h for h in parts if h not in full_metas]
        if missing:
            raise LayoutError(f"{nxd_name} fuses {', '.join(parts)} but {', '.join(missing)} is missing")
        dtypes = {full_metas[h].dtype for h in parts}
        if len(dtypes) > 1:
            raise LayoutError(
                f"{nxd_name} fuses {', '.join(parts)} of different dtypes {sorted(map(str, dtypes))}"
            )
        first = full_metas[parts[0]]
        ps = sorted(ps, key=lambda p: p.nxd_start)
        dim = ps[0].dim
        pieces = tuple(Piece(p.hf_name, None, p.dim, p.hf_start, p.length) for p in ps)
        shape = list(first.shape)
        if dim is not None:
            shape[dim] = sum(p.length for p in ps)
        plans.append(TensorPlan(nxd_name, rank, TensorMeta(tuple(shape), first.dtype), dim, pieces))
    return LayoutPlan(spec, "full_to_nxd", tuple(plans))


# --------------------------------------------------------------------------------------------- NxD -> full


def full_meta_from_local(spec: LayoutSpec, hf_name: str, local: TensorMeta) -> TensorMeta:
    """Full shape of HF tensor ``hf_name`` given the shape of the NxD tensor it is stored in on one rank."""
    m = spec.model
    kind = rule_for(hf_name, spec.rules, spec.rule_set).kind
    shape = list(local.shape)
    if kind is Kind.VOCAB:
        shape[0] *= spec.tp
    elif kind in (Kind.ATTN_Q, Kind.ATTN_KV, Kind.GATE_UP):
        shape[0] = {Kind.ATTN_Q: m.q_rows, Kind.ATTN_KV: m.kv_rows, Kind.GATE_UP: m.intermediate}[kind]
    elif kind is Kind.ATTN_O:
        shape[1] = m.q_rows
    elif kind is Kind.ROW:
        shape[1] *= spec.tp
    return TensorMeta(tuple(shape), local.dtype)


def plan_tensor_nxd_to_full(spec: LayoutSpec, hf_name: str, full: TensorMeta) -> TensorPlan:
    """Plan one full tensor from the NxD rank tensors (canonical copies; other copies as ``replicas``)."""
    by_replica: dict[int, list[Placement]] = {}
    for p in placements(spec, hf_name, full.shape):
        by_replica.setdefault(p.replica, []).append(p)

    def pieces(ps: list[Placement]) -> tuple[Piece, ...]:
        return tuple(
            Piece(p.nxd_name, p.rank, p.dim, p.nxd_start, p.length)
            for p in sorted(ps, key=lambda p: p.hf_start)
        )

    canonical = by_replica.pop(0)
    dim = canonical[0].dim
    replicas = tuple(pieces(ps) for _, ps in sorted(by_replica.items()))
    return TensorPlan(hf_name, None, full, dim, pieces(canonical), replicas)


def plan_nxd_to_full(spec: LayoutSpec, rank_metas: Mapping[Rank, Mapping[str, TensorMeta]]) -> LayoutPlan:
    """Plan every full (HF-named) tensor from NxD rank tensors described by ``rank_metas``.

    The set of rank tensors must be exactly what ``spec`` implies (same names, shapes and dtypes on every
    rank); otherwise a ``LayoutError`` names the first rank tensor that is missing, extra or mis-shaped,
    which usually means a wrong ``--tp``/``--pp``/``--kv-size-multiplier``/``--qkv-linear`` flag.
    """
    for rank in spec.ranks:
        if rank not in rank_metas:
            raise LayoutError(
                f"no tensors for tp rank {rank[0]}, pp rank {rank[1]}; check --tp {spec.tp} --pp {spec.pp}"
            )
    extra_ranks = set(rank_metas) - set(spec.ranks)
    if extra_ranks:
        tp, pp = min(extra_ranks)
        raise LayoutError(f"found tp rank {tp}, pp rank {pp} outside --tp {spec.tp} --pp {spec.pp}")
    check_known(
        (h for rank in spec.ranks for n in rank_metas[rank] for h in nxd_to_hf_names(n, spec.family)),
        spec.rules,
        spec.rule_set,
    )
    full: dict[str, TensorMeta] = {}
    for rank in spec.ranks:
        for nxd_name, meta in rank_metas[rank].items():
            for hf_name in nxd_to_hf_names(nxd_name, spec.family):
                if hf_name not in full:
                    full[hf_name] = full_meta_from_local(spec, hf_name, meta)
    _check_complete(spec, full)
    _check_rank_metas(plan_full_to_nxd(spec, full), rank_metas)
    tensors = tuple(plan_tensor_nxd_to_full(spec, name, meta) for name, meta in full.items())
    return LayoutPlan(spec, "nxd_to_full", tensors)


def _check_complete(spec: LayoutSpec, full: Mapping[str, TensorMeta]) -> None:
    """Every layer, embeddings, final norm and (untied) lm_head must be somewhere; layers must agree."""
    per_layer: dict[int, set[str]] = {}
    for name in full:
        layer = layer_index(name)
        if layer is not None:
            per_layer.setdefault(layer, set()).add(name.split(".", 3)[3])
    missing = sorted(set(range(spec.model.layers)) - set(per_layer))
    if missing:
        raise LayoutError(
            f"layers {missing} are missing on every rank (check --pp {spec.pp} / --virtual-pp {spec.virtual_pp})"
        )
    first = per_layer[0]
    for layer, names in sorted(per_layer.items()):
        if names != first:
            odd = sorted(names ^ first)[0]
            raise LayoutError(f"model.layers.{layer} differs from model.layers.0 in {odd!r}")
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    if not spec.model.tie_word_embeddings:
        required.append("lm_head.weight")
    for name in required:
        if name not in full:
            raise LayoutError(f"{name} is missing on every rank (check --pp {spec.pp})")


def _check_rank_metas(expected: LayoutPlan, rank_metas: Mapping[Rank, Mapping[str, TensorMeta]]) -> None:
    for where, name, have, meta in rank_tensor_pairs(
        expected.spec.ranks,
        rank_metas.__getitem__,
        lambda rank: {t.name: t.meta for t in expected.for_rank(rank)},
        "check --pp / --qkv-linear / --fuse-qkv",
        "check --pp / --virtual-pp / --qkv-linear / --fuse-qkv",
    ):
        if tuple(have.shape) != meta.shape:
            raise LayoutError(
                f"{name} on {where} has shape {list(have.shape)}, this layout expects {list(meta.shape)} "
                "(check --tp / --kv-size-multiplier / config)"
            )
        if have.dtype != meta.dtype:
            raise LayoutError(f"{name} on {where} is {have.dtype}, other ranks hold {meta.dtype}")


def rank_tensor_pairs(
    ranks: Iterable[Rank],
    have_of: Callable[[Rank], Mapping[str, H]],
    want_of: Callable[[Rank], Mapping[str, W]],
    unexpected_hint: str,
    missing_hint: str,
) -> Iterator[tuple[str, str, H, W]]:
    """``(where, name, held, expected)`` for every tensor a layout puts on each rank, rank by rank, for the caller
    to compare; a held tensor the layout does not put on its rank, or one it puts there that is missing, is refused
    (with the hint saying which flags to check) before any pair of that rank is compared."""
    for rank in ranks:
        want, have = want_of(rank), have_of(rank)
        where = f"tp rank {rank[0]}, pp rank {rank[1]}"
        for name in have:
            if name not in want:
                raise LayoutError(f"{name} on {where} is not expected by this layout ({unexpected_hint})")
        for name, w in want.items():
            if name not in have:
                raise LayoutError(f"{name} is missing on {where} ({missing_hint})")
            yield where, name, have[name], w


def metas_of(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, TensorMeta]:
    """``{name: TensorMeta}`` of ``(name, tensor)`` pairs (e.g. ``state_dict.items()``)."""
    return {name: TensorMeta.of(t) for name, t in tensors}
