"""Who writes what: boxes of global tensors, replica de-duplication and chunking.  Pure functions, no I/O.

Every rank describes the pieces it holds (name, global shape, dtype, box).  Ranks holding an identical box of the
same tensor are replicas: exactly one of them writes it, chosen by a greedy balance of bytes so that DDP-style
replicated state is spread over all ranks instead of landing on rank 0.  All ranks compute the same assignment
from the same gathered descriptions, so no further coordination is needed.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .dtypes import itemsize
from .errors import StateMismatchError
from .manifest import Box, TensorDesc

# Tensors are stored in chunks of at most this many bytes along dim 0: a rank restoring a different sharding reads
# at most one chunk beyond its box per tensor edge, and every chunk carries its own checksum.
DEFAULT_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class Piece:
    """What a rank holds of one logical tensor: its description and the box it holds (no data)."""

    desc: TensorDesc
    box: Box

    @property
    def name(self) -> str:
        return self.desc.name

    @property
    def itemsize(self) -> int:
        return itemsize(self.desc.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the held box (not of the whole tensor)."""
        return self.box.numel * self.itemsize


def digest(pieces: list[Piece]) -> str:
    """A stable hash of a rank's pieces, for plan caching across saves."""
    h = hashlib.blake2b(digest_size=16)
    for p in pieces:
        d = p.desc
        h.update(repr((d.name, d.role, d.shape, d.dtype, p.box, d.param, d.key, d.partition)).encode())
    return h.hexdigest()


def assign_writers(per_rank: list[list[Piece]]) -> dict[tuple[str, Box], int]:
    """Pick one writer rank per distinct (tensor, box); balance bytes across ranks.

    Raises StateMismatchError when ranks disagree on a tensor's global shape or dtype.
    """
    holders: dict[tuple[str, Box], list[int]] = {}
    sizes: dict[tuple[str, Box], int] = {}
    meta: dict[str, tuple[tuple[int, ...], str]] = {}
    for rank, pieces in enumerate(per_rank):
        for p in pieces:
            seen = meta.setdefault(p.name, (p.desc.shape, p.desc.dtype))
            if seen != (p.desc.shape, p.desc.dtype):
                raise StateMismatchError(
                    f"tensor {p.name!r}: rank {rank} has shape {list(p.desc.shape)} {p.desc.dtype}, another rank has "
                    f"{list(seen[0])} {seen[1]}"
                )
            holders.setdefault((p.name, p.box), []).append(rank)
            sizes[(p.name, p.box)] = p.nbytes
    load = [0] * len(per_rank)
    out: dict[tuple[str, Box], int] = {}
    for key in sorted(holders, key=lambda k: (-sizes[k], k[0], k[1].offsets)):
        ranks = holders[key]
        writer = min(ranks, key=lambda r: (load[r], r))
        out[key] = writer
        load[writer] += sizes[key]
    return out


def chunk_boxes(box: Box, itemsize: int, chunk_bytes: int) -> list[Box]:
    """Split ``box`` along its first dim into pieces of at most ``chunk_bytes`` (at least one row each)."""
    if not box.lengths or box.lengths[0] <= 1:
        return [box]
    row_bytes = math.prod(box.lengths[1:]) * itemsize
    total = row_bytes * box.lengths[0]
    if total <= chunk_bytes or row_bytes == 0:
        return [box]
    rows = max(1, chunk_bytes // row_bytes)
    out = []
    for start in range(0, box.lengths[0], rows):
        n = min(rows, box.lengths[0] - start)
        out.append(Box((box.offsets[0] + start, *box.offsets[1:]), (n, *box.lengths[1:])))
    return out


def local_box(t: torch.Tensor) -> tuple[tuple[int, ...], Box, torch.Tensor]:
    """(global shape, box held locally, local tensor) for a plain tensor or a DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        from torch.distributed.tensor.placement_types import Replicate, Shard

        for pl in t.placements:
            if not isinstance(pl, (Replicate, Shard)) or type(pl) not in (Replicate, Shard):
                raise StateMismatchError(
                    f"DTensor placement {pl} is not supported (only Shard and Replicate); call full_tensor() "
                    "or redistribute before saving"
                )
        shape = tuple(t.shape)
        local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        return shape, Box(tuple(offset), tuple(local_shape)), local
    shape = tuple(t.shape)
    return shape, Box.full(shape), t
