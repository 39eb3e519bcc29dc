"""Per-rank accounting of a conversion: the source bytes a rank read from storage, what it wrote, how long it took.

What "read" means depends on how a source reaches its bytes, and the count follows the real traffic:

* a source that reads through the storage layer (our format, local or on an object store: it exposes that
  :class:`~ckpt.storage.Storage` as ``storage``) is counted there: every ``read_range`` / ``read_into`` /
  ``read_many`` adds the bytes it fetched (ranged reads included, a read repeated is counted twice: it was fetched
  twice);
* a source that memory-maps local files (HF safetensors, DCP, NxD rank files) reads what its slices touch: each
  read adds its :func:`extents` (the byte span of the stored tensor between the slice's first and last element,
  all of it for a slice across columns of a row-major tensor), and a rank's count is the union of those spans per
  stored tensor (a page read twice comes from the page cache the second time).

:func:`extents` is also what :mod:`.exchange` plans with: two ranks whose extents overlap would read the same bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from ckpt.format.dtypes import dtype_from_name
from ckpt.layouts import Piece

Extent = tuple[Hashable, int, int]  # (what is read: a file or a stored tensor, first byte, end byte)


def stored_shape(source: Any, piece: Piece) -> tuple[int, ...] | None:
    """Shape of the stored tensor ``piece`` slices (rank-local for a Neuron-layout piece); None when unknown."""
    desc = source.tensors.get(piece.name)
    if desc is None:
        return None
    return tuple(source.local_shape(desc) if piece.rank is not None else desc.shape)


def whole(piece: Piece) -> Piece:
    """The stored tensor ``piece`` is a slice of."""
    return Piece(piece.name, piece.rank, None)


def extents(source: Any, piece: Piece) -> list[Extent]:
    """The stored bytes reading ``piece`` touches: the source's own answer (``source.extents``) where it has one,
    else the span of a row-major stored tensor from the slice's first element to its last."""
    own = getattr(source, "extents", None)
    if own is not None:
        return own(piece)
    shape = stored_shape(source, piece)
    if shape is None:
        return []
    key = ("tensor", source.locate(whole(piece)))
    desc = source.tensors[piece.name]
    itemsize = dtype_from_name(desc.dtype).itemsize
    total = stored_bytes(source, piece)
    merged = getattr(source, "zero1", False) and desc.role == "optimizer_state"  # merged over DP files whole
    if piece.dim is None or total == 0 or merged:
        return [(key, 0, total)]
    inner = itemsize
    for s in shape[piece.dim + 1 :]:
        inner *= int(s)
    outer = 1
    for s in shape[: piece.dim]:
        outer *= int(s)
    row = int(shape[piece.dim]) * inner
    first = piece.start * inner
    end = (outer - 1) * row + (piece.start + piece.length) * inner
    return [(key, first, end)]


def union_bytes(spans: list[tuple[int, int]]) -> int:
    """Bytes covered by the half-open intervals ``spans``."""
    total, reach = 0, None
    for s, e in sorted(spans):
        if reach is None or s > reach:
            total += e - s
            reach = e
        elif e > reach:
            total += e - reach
            reach = e
    return total


def needed_bytes(source: Any, pieces: Iterable[Piece]) -> int:
    """The stored bytes reading ``pieces`` touches, each byte once (the union of their :func:`extents`): what a
    reader of all of them must fetch at least."""
    spans: dict[Hashable, list[tuple[int, int]]] = {}
    for p in pieces:
        for key, s, e in extents(source, p):
            spans.setdefault(key, []).append((s, e))
    return sum(union_bytes(v) for v in spans.values())


def stored_bytes(source: Any, piece: Piece) -> int:
    """Bytes of the stored tensor ``piece`` slices (0 when the source does not describe it)."""
    shape = stored_shape(source, piece)
    if shape is None:
        return 0
    n = dtype_from_name(source.tensors[piece.name].dtype).itemsize
    for s in shape:
        n *= int(s)
    return n


class ReadMeter:
    """The source bytes one process read (see the module docstring for what is counted, and how)."""

    def __init__(self) -> None:
        self.storage_bytes = 0
        self._spans: dict[Hashable, list[tuple[int, int]]] = {}
        self._depth = 0  # inside a counted storage call: its inner calls are the same bytes
        self._lock = threading.Lock()

    @property
    def bytes_read(self) -> int:
        return self.storage_bytes + sum(union_bytes(s) for s in self._spans.values())

    def touched(self, spans: list[Extent]) -> None:
        for key, s, e in spans:
            if e > s:
                self._spans.setdefault(key, []).append((s, e))

    def attach(self, storage: Any) -> None:
        """Count what ``storage`` (this instance only) fetches from now on."""

        def counted(fn: Callable[..., Any], size: Callable[..., int]) -> Callable[..., Any]:
            def call(*args: Any, **kw: Any) -> Any:
                with self._lock:
                    outer = self._depth == 0
                    self._depth += 1
                try:
                    out = fn(*args, **kw)
                finally:
                    with self._lock:
                        self._depth -= 1
                if outer:
                    with self._lock:
                        self.storage_bytes += size(args, kw, out)
                return out

            return call

        def arg(args: tuple[Any, ...], kw: dict[str, Any], i: int, name: str) -> Any:
            return args[i] if len(args) > i else kw[name]

        storage.read_bytes = counted(storage.read_bytes, lambda a, kw, result: len(result))
        storage.read_range = counted(storage.read_range, lambda a, kw, result: len(result))
        storage.read_into = counted(
            storage.read_into, lambda a, kw, result: memoryview(arg(a, kw, 2, "out")).nbytes
        )
        storage.read_many = counted(
            storage.read_many,
            lambda a, kw, result: sum(memoryview(r.out).nbytes for r in arg(a, kw, 0, "reads")),
        )


class MeteredSource:
    """``source`` with every read counted by ``meter``: at its storage layer when it has one, else by extents.

    A proxy, not a :class:`~.source.Source` subclass: every attribute is the wrapped source's own.
    """

    def __init__(self, source: Any, meter: ReadMeter) -> None:
        self._source = source
        self._meter = meter
        storage = getattr(source, "storage", None)
        self._by_extent = storage is None
        if storage is not None:
            meter.attach(storage)

    def read(self, piece: Piece) -> Any:
        if self._by_extent:
            self._meter.touched(extents(self._source, piece))
        return self._source.read(piece)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)


@dataclass
class RankStats:
    """One rank's line of the report."""

    rank: int
    bytes_read: int
    bytes_written: int
    seconds: float
    #: tensor bytes other ranks read and shipped to this one (:mod:`.exchange`), not counted in ``bytes_read``
    bytes_received: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3),
            "bytes_received": self.bytes_received,
        }


class Clock:
    """Seconds since this rank started its part of the conversion."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start


__all__ = [
    "Clock",
    "Extent",
    "MeteredSource",
    "RankStats",
    "ReadMeter",
    "extents",
    "needed_bytes",
    "stored_bytes",
    "union_bytes",
    "whole",
]
