"""Many reads from object storage as a few large ranged GETs, several in flight, straight into the destinations.

A restore asks for many stored chunks (8 MiB each by default), mostly back to back in one data file.  One GET per
chunk, one after the other, leaves the connection idle between requests and pays a request's latency per chunk.
:func:`plan_pieces` coalesces reads that are adjacent in a file into pieces of at most ``max_piece`` bytes (and
splits a read larger than that), and :func:`read_pieces` fetches ``in_flight`` pieces at a time on worker threads,
copying each piece's bytes into the slices of the destination buffers it covers.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ckpt.errors import StorageError

from . import Read, ReadFailed


class RangedGet(NamedTuple):
    """One ranged GET: ``length`` bytes of ``rel`` at ``start``; ``spans`` say where they go:
    ``(read index, offset in that read's out, offset in this piece, bytes)``."""

    rel: str
    start: int
    length: int
    spans: tuple[tuple[int, int, int, int], ...]


def plan_pieces(reads: Sequence[Read], max_piece: int) -> list[RangedGet]:
    """Cover every byte of every read exactly once with pieces of at most ``max_piece`` bytes, each a contiguous
    range of one file; reads adjacent in a file share pieces."""
    if max_piece <= 0:
        raise ValueError(f"max_piece must be positive, got {max_piece}")
    order = sorted(range(len(reads)), key=lambda i: (reads[i].rel, reads[i].start))
    pieces: list[RangedGet] = []
    rel, start, length, spans = "", 0, 0, []  # the piece being built (length 0: none)
    for i in order:
        r = reads[i]
        n = len(r.out)
        done = 0
        while done < n:
            pos = r.start + done
            if length and (r.rel != rel or start + length != pos or length >= max_piece):
                pieces.append(RangedGet(rel, start, length, tuple(spans)))
                length = 0
            if not length:
                rel, start, spans = r.rel, pos, []
            take = min(n - done, max_piece - length)
            spans.append((i, done, length, take))
            length += take
            done += take
    if length:
        pieces.append(RangedGet(rel, start, length, tuple(spans)))
    return pieces


def read_pieces(
    fetch: Callable[[str, int, int], bytes],
    reads: Sequence[Read],
    pieces: Sequence[RangedGet],
    in_flight: int,
    on_block: Callable[[int, memoryview], None] | None = None,
) -> None:
    """Fetch ``pieces`` with ``fetch(rel, start, length)`` (exactly ``length`` bytes or an error), ``in_flight``
    at a time, into ``reads``; ``on_block(i, reads[i].out)`` once read ``i`` is complete.

    The first failure cancels the pieces not yet started, waits for those running (none writes into a
    destination after this returns) and is raised as :class:`ReadFailed` for a read the failed piece serves.
    """
    remaining = [len(r.out) for r in reads]
    lock = threading.Lock()

    def run(p: RangedGet) -> None:
        try:
            data = fetch(p.rel, p.start, p.length)
            if len(data) != p.length:
                raise StorageError(f"{p.rel}: short read at {p.start}: got {len(data)} of {p.length} bytes")
        except (OSError, StorageError) as e:
            raise ReadFailed(p.spans[0][0], e) from e
        view = memoryview(data)
        for i, off, poff, n in p.spans:
            reads[i].out[off : off + n] = view[poff : poff + n]
        finished = []
        with lock:
            for i, _, _, n in p.spans:
                remaining[i] -= n
                if remaining[i] == 0:
                    finished.append(i)
        if on_block is not None:
            for i in finished:
                on_block(i, reads[i].out)

    if len(pieces) <= 1 or in_flight <= 1:
        for p in pieces:
            run(p)
        return
    with cf.ThreadPoolExecutor(min(in_flight, len(pieces)), thread_name_prefix="ckpt-get") as pool:
        futures = [pool.submit(run, p) for p in pieces]
        done, _ = cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
        failed = next((f for f in futures if f in done and f.exception() is not None), None)
        if failed is not None:
            for f in futures:
                f.cancel()
            cf.wait(futures)
            raise failed.exception()  # type: ignore[misc]
