"""Who writes what: boxes of global tensors, replica de-duplication and chunking.  Pure functions, no I/O.

Every rank describes the pieces it holds (name, global shape, dtype, box).  Ranks holding an identical box of the
same tensor are replicas: exactly one of them writes it, chosen by a greedy balance of bytes so that DDP-style
replicated state is spread over the replicas instead of landing on rank 0.

Two ways to agree on the writers (docs/format.md has none of this: it is how a save runs, not what it writes):

- **local** (:func:`plan_local`, the default): a rank knows from its own placements which *replica group* holds
  each of its pieces (a DTensor's Replicate mesh dims, NxD's DP ranks, every rank for a plain tensor) without
  asking anyone, as a :class:`Group` (a key, a size and the rank's position).  Members of a group hold the same
  pieces, so each computes the same greedy balance over the group's pieces alone: per-rank cost O(T), no
  exchange.  One all-reduce of two numbers (:func:`plan_check`) proves that every member of every group computed
  the same thing (a rank whose description differs breaks the sums), whatever the world size.
- **exact** (:func:`assign_writers`): every rank's pieces gathered everywhere and one global balance; O(N x T)
  per rank.  Used when a piece has no derivable group, or when the check fails, so that any disagreement is
  still found and named.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import StateMismatchError
from ..format.dtypes import itemsize
from ..format.manifest import Box, TensorDesc

# Tensors are stored in chunks of at most this many bytes along dim 0: a rank restoring a different sharding reads
# at most one chunk beyond its box per tensor edge, and every chunk carries its own checksum.
DEFAULT_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class HeldBox:
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


def digest(pieces: list[HeldBox]) -> str:
    """A stable hash of a rank's pieces, for plan caching across saves."""
    h = hashlib.blake2b(digest_size=16)
    for p in pieces:
        d = p.desc
        h.update(repr((d.name, d.role, d.shape, d.dtype, p.box, d.param, d.key, d.partition)).encode())
    return h.hexdigest()


def assign_writers(per_rank: list[list[HeldBox]]) -> dict[tuple[str, Box], int]:
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


# ------------------------------------------------------------------------------------------------ local planning

# Sums in plan_check are kept modulo this prime so that the all-reduced totals of 2**32 ranks fit an int64.
CHECK_MOD = (1 << 31) - 1


@dataclass(frozen=True)
class Group:
    """The replica group of a piece, as one member sees it without asking the others.

    ``key`` names the group identically on every member (and differently for groups with other members),
    ``size`` is how many ranks hold the piece, ``index`` this rank's position among them (0..size-1).
    """

    key: tuple[Any, ...]
    size: int
    index: int


def _h64(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little")


def plan_local(pieces: Sequence[HeldBox], groups: Sequence[Group]) -> tuple[list[bool], tuple[int, int]]:
    """Which of this rank's pieces it writes, and its contribution to :func:`plan_check`.

    Per group (members hold the same pieces): pieces by decreasing bytes (then name, offsets), each to the
    least-loaded member, ties broken in an order rotated by the group's key so that different groups' largest
    pieces do not all land on their first member.  Cost O(P log min(P, size)) for P pieces, independent of the
    world size.  Returns (write flags aligned with ``pieces``, (a, b)): ``a`` sums a hash of every held piece,
    ``b`` sums ``size`` times the hash of every piece this rank writes; over all ranks the two totals are equal
    when every member of every group agreed (each piece counted ``size`` times in both).  A second pair of terms
    (a tensor's hash times the elements of each written box, against times its whole size for the box at its
    origin) makes the totals differ too when the written boxes do not tile a tensor or ranks in different groups
    disagree on its shape or dtype.
    """
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, g in enumerate(groups):
        if not 0 <= g.index < g.size:
            raise ValueError(f"piece {pieces[i].name!r}: group index {g.index} outside size {g.size}")
        buckets.setdefault(g.key, []).append(i)
    write = [False] * len(pieces)
    a = b = 0
    for key, idx in buckets.items():
        size = groups[idx[0]].size
        start = _h64(key) % size
        order = sorted(idx, key=lambda i: (-pieces[i].nbytes, pieces[i].name, pieces[i].box.offsets))
        # slots beyond the first len(order) in tie order are never chosen while a zero-load slot is left
        heap = [(0, j, (start + j) % size) for j in range(min(size, len(order)))]
        for i in order:
            load, j, slot = heapq.heappop(heap)
            p = pieces[i]
            heapq.heappush(heap, (load + p.nbytes, j, slot))
            g = groups[i]
            if g.size != size:
                raise ValueError(f"piece {p.name!r}: group {key!r} has sizes {size} and {g.size}")
            d = p.desc
            c = _h64((key, size, d.name, d.role, d.shape, d.dtype, d.param, d.key, p.box)) % CHECK_MOD
            a = (a + c) % CHECK_MOD
            if slot == g.index:
                write[i] = True
                b = (b + size * c) % CHECK_MOD
                # tiling and agreement across groups: the writers' boxes of a tensor add up to the tensor, counted
                # by the writer of its first element; a rank with another shape/dtype breaks this too
                t = _h64((d.name, d.role, d.shape, d.dtype, d.param, d.key)) % CHECK_MOD
                b = (b + t * p.box.numel) % CHECK_MOD
                if p.box.numel and not any(p.box.offsets):
                    a = (a + t * math.prod(d.shape)) % CHECK_MOD
    return write, (a, b)


def plan_check(totals: Sequence[int]) -> bool:
    """Whether the all-reduced (a, b) of :func:`plan_local` prove that every group agreed."""
    return totals[0] % CHECK_MOD == totals[1] % CHECK_MOD


def mesh_group(
    mesh_key: Any, mesh_shape: Sequence[int], replicate: Sequence[bool], coord: Sequence[int]
) -> Group:
    """The replica group of a DTensor piece: ranks that differ from ``coord`` only on Replicate mesh dims hold
    the same box.  ``mesh_key`` tells meshes apart (the saver uses a hash of the mesh's rank grid)."""
    size, index = 1, 0
    for n, rep, c in zip(mesh_shape, replicate, coord, strict=True):
        if rep:
            size *= n
            index = index * n + c
    fixed = tuple(c if not rep else -1 for rep, c in zip(replicate, coord, strict=True))
    return Group(("mesh", mesh_key, tuple(mesh_shape), tuple(replicate), fixed), size, index)


def dtensor_group(t: Any) -> Group:
    """:func:`mesh_group` of a DTensor (its mesh, placements and this rank's coordinate)."""
    from torch.distributed.tensor.placement_types import Replicate

    mesh = t.device_mesh
    key = _MESH_KEYS.get(id(mesh))
    if key is None or key[0] is not mesh:
        key = (mesh, _h64(tuple(mesh.mesh.flatten().tolist())))
        _MESH_KEYS[id(mesh)] = key
    coord = mesh.get_coordinate()
    assert coord is not None, "a rank outside the DTensor's mesh holds no piece of it"
    return mesh_group(key[1], tuple(mesh.shape), [isinstance(pl, Replicate) for pl in t.placements], coord)


_MESH_KEYS: dict[int, tuple[Any, int]] = {}


def world_group(rank: int, world: int) -> Group:
    """A plain (non-DTensor) tensor on a multi-rank job: assumed held whole by every rank (DDP), which
    :func:`plan_check` verifies."""
    return Group(("world",), world, rank)
