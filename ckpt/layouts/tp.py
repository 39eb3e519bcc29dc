"""Tensor-parallel split and merge along one partition dim, with NxD's ``stride``.

NxD's ``create_local_weight`` cuts the full tensor into ``tp * stride`` equal chunks along the partition dim
and gives rank ``r`` the chunks ``r, r + tp, r + 2*tp, ...`` concatenated.  ``stride=1`` is the plain
contiguous split; ``stride=2`` on ``cat[gate, up]`` gives each rank ``cat[gate_r, up_r]`` (how
``gate_up_proj`` is stored).  Ranges are computed first (plans), tensors are cut second.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ckpt.errors import LayoutError


def strided_ranges(size: int, tp: int, rank: int, stride: int = 1) -> tuple[tuple[int, int], ...]:
    """``(start, length)`` ranges of the full dim that rank ``rank`` holds, in its stored order."""
    if size % (tp * stride):
        raise LayoutError(f"--tp {tp} x stride {stride} does not divide a partition dim of size {size}")
    chunk = size // (tp * stride)
    return tuple(((k * tp + rank) * chunk, chunk) for k in range(stride))


def split(full: torch.Tensor, dim: int, tp: int, rank: int, stride: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (a new tensor, never a view of ``full``)."""
    parts = [
        full.narrow(dim, start, length) for start, length in strided_ranges(full.shape[dim], tp, rank, stride)
    ]
    return torch.cat(parts, dim=dim)


def merge(shards: Sequence[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`split` over all ranks (``shards[r]`` is rank ``r``'s shard)."""
    tp = len(shards)
    pieces: list[torch.Tensor] = []
    for k in range(stride):
        for r in range(tp):
            chunk = shards[r].shape[dim] // stride
            pieces.append(shards[r].narrow(dim, k * chunk, chunk))
    return torch.cat(pieces, dim=dim)


def runs(indices: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Collapse ascending-by-one stretches of ``indices`` into ``(start, length)`` runs, keeping order."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return tuple(out)
