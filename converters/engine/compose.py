"""Plan algebra: renaming a plan, dropping replicas that are the same stored bytes, and composing a target plan
(pieces of full tensors) with the full view (full tensors as source pieces) into pieces of the source.

Pieces are 1-d slices (``dim``, ``start``, ``length``) of one stored tensor; a full tensor and every target slice
of it are split along the same dim (one rule per tensor), so composing is interval arithmetic along that dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from ckpt.errors import LayoutError
from ckpt.layouts import Piece, TensorMeta, TensorPlan

from .source import Source


def rename_plan(plan: TensorPlan, name: str, dtype_: Any, rename: Callable[[str], str]) -> TensorPlan:
    """``plan`` for a tensor laid out like it (an optimizer moment of a parameter): new name, dtype, piece names."""

    def pieces(ps: tuple[Piece, ...]) -> tuple[Piece, ...]:
        return tuple(dataclasses.replace(p, name=rename(p.name)) for p in ps)

    return dataclasses.replace(
        plan,
        name=name,
        meta=TensorMeta(plan.meta.shape, dtype_),
        pieces=pieces(plan.pieces),
        replicas=tuple(pieces(r) for r in plan.replicas),
    )


def dedup_replicas(source: Source, plan: TensorPlan) -> TensorPlan:
    """Drop replica piece lists that read the very same stored bytes as the canonical one or an earlier replica."""
    seen: set[tuple[Hashable, ...]] = {tuple(source.locate(p) for p in plan.pieces)}
    kept = []
    for rep in plan.replicas:
        key = tuple(source.locate(p) for p in rep)
        if key not in seen:
            seen.add(key)
            kept.append(rep)
    return dataclasses.replace(plan, replicas=tuple(kept)) if len(kept) != len(plan.replicas) else plan


def _narrow(q: Piece, dim: int, start: int, length: int, where: str) -> Piece:
    if q.dim is None:
        return Piece(q.name, q.rank, dim, start, length)
    if q.dim != dim:
        raise LayoutError(
            f"{where}: cannot take a dim-{dim} slice of a dim-{q.dim} piece (unsupported layout)"
        )
    return Piece(q.name, q.rank, dim, q.start + start, length)


def _merge_runs(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Adjacent slices of one stored tensor that continue each other become one piece (fewer, bigger copies)."""
    out: list[Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if (
            last is not None
            and p.dim is not None
            and (last.name, last.rank, last.dim) == (p.name, p.rank, p.dim)
            and last.start + last.length == p.start
        ):
            out[-1] = dataclasses.replace(last, length=last.length + p.length)
        else:
            out.append(p)
    return tuple(out)


def compose(
    target: TensorPlan, full: Mapping[str, TensorPlan], pick: Mapping[str, int] | None = None
) -> TensorPlan:
    """``target`` (pieces of full tensors) with every piece replaced by the source pieces it is made of.

    ``pick[name] = j`` reads full tensor ``name`` from its ``j``-th replica (1-based) instead of its canonical
    pieces: the variants the executor compares.
    """
    pick = pick or {}
    out: list[Piece] = []
    for p in target.pieces:
        fp = full[p.name]
        j = pick.get(p.name, 0)
        chosen = fp.pieces if j == 0 else fp.replicas[j - 1]
        if p.dim is None:
            if target.dim is None:  # the whole full tensor is the target (one piece)
                return dataclasses.replace(target, dim=fp.dim, pieces=chosen, replicas=())
            if fp.dim not in (None, target.dim):
                raise LayoutError(
                    f"{target.name}: {p.name} is split along dim {fp.dim}, fused along {target.dim}"
                )
            out.extend(chosen)
        elif fp.dim is None:
            out.append(_narrow(chosen[0], p.dim, p.start, p.length, target.name))
        elif fp.dim == p.dim:
            pos = 0
            for q in chosen:
                lo, hi = max(p.start, pos), min(p.start + p.length, pos + q.length)
                if lo < hi:
                    out.append(Piece(q.name, q.rank, q.dim, q.start + lo - pos, hi - lo))
                pos += q.length
        else:
            raise LayoutError(
                f"{target.name}: {p.name} is split along dim {fp.dim}, the target along {p.dim}"
            )
    return dataclasses.replace(target, pieces=_merge_runs(out), replicas=())


def compose_all(target: TensorPlan, full: Mapping[str, TensorPlan]) -> TensorPlan:
    """:func:`compose` with every replica of every full tensor involved as a variant to compare."""
    base = compose(target, full)
    variants = []
    for name in dict.fromkeys(p.name for p in target.pieces):
        for j in range(len(full[name].replicas)):
            variants.append(compose(target, full, {name: j + 1}).pieces)
    return dataclasses.replace(base, replicas=tuple(variants))


__all__ = ["compose", "compose_all", "dedup_replicas", "rename_plan"]
