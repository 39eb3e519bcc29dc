"""Read once, ship blocks: torchrun ranks that need the same stored bytes get them from the one rank that read them.

Every rank writes whole output units (:func:`~.export.balance`), and a unit reads the source pieces its parts are
made of.  Where the units of different ranks touch the same stored bytes, each rank reading them itself multiplies
the read traffic.  The common case is a tensor split by columns: a RowParallel ``o_proj`` / ``down_proj`` is
row-major on disk, so every rank that needs a column block touches every page of it (TP 32: 32 times the bytes;
from S3, whole-object GETs per rank).  Replicated tensors written into every target rank's file (norms) are the
other case.

The plan (:func:`plan_exchange`) is a pure function of the conversion plan and the shares, computed on every rank
without talking: for each rank, the pieces its units read (``export.unit_parts``), and for each stored byte range
(:func:`~.meter.extents`), which ranks touch it.  A stored tensor whose ranges are touched by more than one rank is
*shared*: one rank (the least loaded so far, largest tensors first) reads it whole, once, and sends every other rank
exactly the blocks it needs over the process group (point to point, gloo on CPU).  Everything else, row slices
included (disjoint byte ranges of a row-major tensor), is read by the rank that needs it, as before.  So no stored
byte is read by two ranks.

The exchange runs before the units are written, shared tensors in one global order, so every send meets its
receive (no cycle: a rank only ever waits on a step every rank before it in that order has completed).  A rank
keeps the blocks it received (:class:`BlockStore`: in memory up to a budget, then spooled to a local scratch file
and memory-mapped) and serves them to its units (:class:`ServedSource`).  An owner that cannot read a shared tensor
tells its consumers (a header before each block), finishes the exchange and fails; they read the tensor themselves
when their units need it, and fail with the source's own error, so a damaged SRC fails exactly the ranks that need
it, as without the exchange.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckpt.format.dtypes import dtype_from_name
from ckpt.layouts import Piece

from .meter import extents, stored_bytes, stored_shape, whole
from .source import slice_of

#: blocks a rank keeps in memory before spooling the rest to a scratch file
MEMORY_BUDGET = 256 << 20


def _order(p: Piece) -> tuple[Any, ...]:
    return (p.name, p.rank or (), -1 if p.dim is None else p.dim, p.start, p.length)


def unit_pieces(export: Any, units: Iterable[int]) -> set[Piece] | None:
    """The source pieces (canonical and replica variants) the parts of ``units`` are made of; None when the
    export cannot say which parts a unit holds (then no exchange is planned: each rank reads what it needs)."""
    parts_of = getattr(export, "unit_parts", None)
    if parts_of is None:
        return None
    out: set[Piece] = set()
    for u in units:
        for part in parts_of(u):
            out.update(part.plan.pieces)
            for variant in part.plan.replicas:
                out.update(variant)
    return out


@dataclass(frozen=True)
class Shared:
    """A stored tensor read once, by ``owner``, and shipped: ``wants`` lists (rank, the pieces it needs)."""

    tensor: Piece
    owner: int
    nbytes: int
    wants: tuple[tuple[int, tuple[Piece, ...]], ...]


def _overlap(per_rank: dict[int, list[tuple[int, int]]]) -> bool:
    """Do the byte ranges of two different ranks overlap?  (Each rank's own ranges may overlap each other.)"""
    merged: list[tuple[int, int]] = []
    for spans in per_rank.values():
        reach = None
        for s, e in sorted(spans):  # one rank's union first: its own overlaps do not count
            if reach is not None and s <= reach:
                merged[-1] = (merged[-1][0], max(reach, e))
                reach = max(reach, e)
            else:
                merged.append((s, e))
                reach = e
    merged.sort()
    reach = None
    for s, e in merged:
        if reach is not None and s < reach:
            return True
        reach = e if reach is None else max(reach, e)
    return False


def plan_exchange(source: Any, needs: Sequence[set[Piece]]) -> list[Shared]:
    """The stored tensors more than one rank touches (``needs[r]``: the pieces rank ``r`` reads), each with the
    rank that reads it and the blocks it ships; deterministic (every rank computes the same list)."""
    touched: dict[Hashable, dict[int, list[tuple[int, int]]]] = {}
    for r, pieces in enumerate(needs):
        for p in pieces:
            for key, s, e in extents(source, p):
                if e > s:
                    touched.setdefault(key, {}).setdefault(r, []).append((s, e))
    contested = {k for k, per in touched.items() if len(per) > 1 and _overlap(per)}
    groups: dict[Piece, dict[int, set[Piece]]] = {}
    for r, pieces in enumerate(needs):
        for p in pieces:
            if p.name not in source.tensors:
                continue  # a view the source composes itself (MoE expert slots): read where needed
            if any(key in contested for key, _, _ in extents(source, p)):
                groups.setdefault(whole(p), {}).setdefault(r, set()).add(p)
    load = [0] * len(needs)
    out = []
    for t in sorted(groups, key=lambda t: (-stored_bytes(source, t), _order(t))):
        per = groups[t]
        if len(per) < 2:
            continue  # the contested bytes are another stored tensor's (the same bytes under two names)
        n = stored_bytes(source, t)
        owner = min(per, key=lambda r: (load[r], r))
        load[owner] += n
        wants = tuple((r, tuple(sorted(per[r], key=_order))) for r in sorted(per))
        out.append(Shared(t, owner, n, wants))
    return out


class BlockStore:
    """The blocks a rank received (or cut for itself), by piece: in memory up to ``budget`` bytes, then in a scratch
    file of the local temp folder, memory-mapped back when read."""

    def __init__(self, budget: int = MEMORY_BUDGET) -> None:
        self.budget = budget
        self._mem: dict[Piece, torch.Tensor] = {}
        self._spooled: dict[Piece, tuple[int, tuple[int, ...], torch.dtype]] = {}
        self._held = 0
        self._file: Any = None
        self._map: mmap.mmap | None = None
        self.received = 0

    def __contains__(self, piece: Piece) -> bool:
        return piece in self._mem or piece in self._spooled

    def put(self, piece: Piece, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self._held + n <= self.budget or n == 0:
            self._mem[piece] = t.contiguous()
            self._held += n
            return
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="ckpt-blocks-")  # noqa: SIM115 - closed in close()
        offset = self._file.seek(0, os.SEEK_END)
        self._file.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        self._spooled[piece] = (offset, tuple(t.shape), t.dtype)
        self._map = None

    def get(self, piece: Piece) -> torch.Tensor:
        t = self._mem.get(piece)
        if t is not None:
            return t
        offset, shape, dtype = self._spooled[piece]
        if self._map is None:
            self._file.flush()
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        n = dtype.itemsize
        for s in shape:
            n *= s
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        return (
            torch.frombuffer(self._map, dtype=torch.uint8, count=n, offset=offset).view(dtype).reshape(shape)
        )

    def close(self) -> None:
        self._mem.clear()
        self._spooled.clear()
        self._map = None  # closes with its last view
        if self._file is not None:
            self._file.close()
            self._file = None


class ServedSource:
    """``source`` whose reads are served from ``store`` where the exchange delivered them (a proxy: every other
    attribute is the source's own)."""

    def __init__(self, source: Any, store: BlockStore) -> None:
        self._source = source
        self._store = store

    def read(self, piece: Piece) -> torch.Tensor:
        if piece in self._store:
            return self._store.get(piece)
        return self._source.read(piece)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)


def _piece_shape(source: Any, p: Piece) -> tuple[tuple[int, ...], torch.dtype]:
    shape = list(stored_shape(source, p) or ())
    if p.dim is not None:
        shape[p.dim] = p.length
    return tuple(shape), dtype_from_name(source.tensors[p.name].dtype)


def exchange(shared: Sequence[Shared], source: Any, rank: int, store: BlockStore) -> list[str]:
    """Run the exchange on this rank (every rank calls it with the same ``shared``): read the tensors it owns and
    send their blocks, receive the blocks it needs.  Returns the errors of the tensors it could not read (the
    exchange itself always completes, so that no rank waits forever)."""
    import torch.distributed as dist

    errors: list[str] = []
    tag = 0
    for t in shared:
        if rank == t.owner:
            try:
                data = source.read(t.tensor)
                want_shape, want_dtype = _piece_shape(source, t.tensor)
                if tuple(data.shape) != want_shape or data.dtype != want_dtype:
                    raise ValueError(
                        f"{t.tensor.name}: read {list(data.shape)} {data.dtype}, the source describes "
                        f"{list(want_shape)} {want_dtype}"
                    )
                ok = True
            except Exception as e:  # noqa: BLE001 - told to the consumers, then raised by the caller
                errors.append(f"{t.tensor.name}: {e}")
                data, ok = None, False
            pending, keep = [], []
            for r, pieces in t.wants:
                if r == rank:
                    if ok:
                        for p in pieces:
                            store.put(p, slice_of(data, p).clone())
                    continue
                header = torch.tensor([1 if ok else 0], dtype=torch.int64)
                keep.append(header)
                pending.append(dist.isend(header, r, tag=tag))
                tag += 1
                for p in pieces:
                    if ok:
                        block = slice_of(data, p).contiguous().reshape(-1).view(torch.uint8)
                        if block.numel():
                            keep.append(block)
                            pending.append(dist.isend(block, r, tag=tag))
                    tag += 1
            for req in pending:
                req.wait()
            del data, keep
        else:
            for r, pieces in t.wants:
                if r == t.owner:
                    continue  # the owner's own blocks travel nowhere (and use no tag)
                if r != rank:
                    tag += 1 + len(pieces)
                    continue
                header = torch.zeros(1, dtype=torch.int64)
                dist.recv(header, t.owner, tag=tag)
                tag += 1
                for p in pieces:
                    shape, dtype = _piece_shape(source, p)
                    n = dtype.itemsize
                    for s in shape:
                        n *= s
                    if header.item() == 1 and n:
                        buf = torch.empty(n, dtype=torch.uint8)
                        dist.recv(buf, t.owner, tag=tag)
                        store.put(p, buf.view(dtype).reshape(shape))
                        store.received += n
                    elif header.item() == 1:
                        store.put(p, torch.empty(shape, dtype=dtype))
                    tag += 1
    return errors


__all__ = [
    "BlockStore",
    "MEMORY_BUDGET",
    "ServedSource",
    "Shared",
    "exchange",
    "plan_exchange",
    "unit_pieces",
]
