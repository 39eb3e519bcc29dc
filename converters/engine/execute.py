"""Executing a plan: each target part is read from the source pieces it is made of, copied into place once.

A part made of one piece is handed on as the source gave it (a view of an mmap'd rank file or safetensors slice,
no copy); a part made of several pieces is allocated once and each piece is copied straight into its slot.  Replica
variants (other stored copies of the same bytes: KV copies, every TP rank's norm) are compared slot by slot against
the part before it is handed on, so a divergent copy is refused, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ckpt.errors import LayoutError
from ckpt.layouts import Piece, TensorPlan, bit_equal
from ckpt.saving.writer import StreamingWriter

from .plan import Conversion, OutPart

Read = Callable[[Piece], torch.Tensor]


def _check(plan: TensorPlan, piece: Piece, t: torch.Tensor) -> None:
    if t.dtype != plan.meta.dtype:
        raise LayoutError(f"{plan.name}: piece {piece.name} is {t.dtype}, the plan expects {plan.meta.dtype}")


def assemble(plan: TensorPlan, pieces: Iterable[Piece], read: Read) -> torch.Tensor:
    """The tensor ``plan`` describes, made of ``pieces`` (its canonical pieces or a replica variant)."""
    pieces = tuple(pieces)
    if len(pieces) == 1:
        out = read(pieces[0])
        _check(plan, pieces[0], out)
    else:
        if plan.dim is None:
            raise LayoutError(f"{plan.name}: {len(pieces)} pieces but no dim to place them along")
        out = torch.empty(plan.meta.shape, dtype=plan.meta.dtype)
        offset = 0
        for p in pieces:
            src = read(p)
            _check(plan, p, src)
            n = src.shape[plan.dim]
            if offset + n > out.shape[plan.dim]:
                raise LayoutError(f"{plan.name}: pieces overflow the planned shape {list(plan.meta.shape)}")
            out.narrow(plan.dim, offset, n).copy_(src)
            offset += n
        if offset != out.shape[plan.dim]:
            raise LayoutError(
                f"{plan.name}: pieces fill {offset} of {out.shape[plan.dim]} along dim {plan.dim}"
            )
    if tuple(out.shape) != plan.meta.shape:
        raise LayoutError(
            f"{plan.name}: assembled {list(out.shape)}, the plan expects {list(plan.meta.shape)}"
        )
    return out


def _ranks(pieces: Iterable[Piece]) -> str:
    ranks = sorted({p.rank for p in pieces if p.rank is not None})
    return ", ".join(f"tp {t} pp {p}" for t, p in ranks) or "the source"


def check_replicas(plan: TensorPlan, out: torch.Tensor, read: Read) -> None:
    """Every replica variant of ``plan`` must hold exactly the bytes of ``out`` (compared piece by piece)."""
    for variant in plan.replicas:
        if plan.dim is None or len(variant) == 1:
            same = bit_equal(out, assemble(plan, variant, read))
        else:
            same, offset = True, 0
            for p in variant:
                src = read(p)
                n = src.shape[plan.dim]
                if not bit_equal(out.narrow(plan.dim, offset, n), src):
                    same = False
                    break
                offset += n
        if not same:
            canon = _ranks(plan.pieces)
            raise LayoutError(
                f"{plan.name}: the copy stored on {_ranks(variant)} differs from the one on {canon}; replicated "
                "copies must be identical (a desynchronised run, or a wrong --hw / --kv-size-multiplier)"
            )


def produce(conv: Conversion, part: OutPart, *, verify: bool = True) -> torch.Tensor:
    """The data of one target part.  Replicas are always compared: ``verify`` (checksums) is about damaged bytes,
    a replica that diverged is an intact file holding the wrong state, and keeping one copy of it would silently
    pick a rank.  The cost is reading every stored copy once (norms, KV copies: a small share of a model)."""
    del verify  # replicas are compared whatever it says (see above)
    read = conv.source.read
    out = assemble(part.plan, part.plan.pieces, read)
    if part.plan.replicas:
        check_replicas(part.plan, out, read)
    if part.plan.transpose:  # one expert slot of a stacked MoE tensor (converters/engine/experts.py)
        out = out.transpose(0, 1).unsqueeze(0).contiguous()
    return out


def write_share(
    conv: Conversion,
    writer: StreamingWriter,
    indices: Iterable[int] | None = None,
    progress: Callable[[int], None] | None = None,
    *,
    verify: bool = True,
) -> None:
    """Add target tensors ``indices`` (all by default) to ``writer``, part by part."""
    for i in indices if indices is not None else range(len(conv.tensors)):
        out = conv.tensors[i]
        d = out.desc
        for part in out.parts:
            writer.add(
                d.name,
                produce(conv, part, verify=verify),
                role=d.role,
                shape=d.shape,
                box=part.box,
                param=d.param,
                key=d.key,
                partition=d.partition,
            )
        if progress is not None:
            progress(d.nbytes)


__all__ = ["assemble", "check_replicas", "produce", "write_share"]
