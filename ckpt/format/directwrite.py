"""Writing a data file with direct I/O (``O_DIRECT``) from a page-aligned arena: the disk reads the saved bytes by
DMA, so they are never copied into the page cache.

On this project's VM a buffered ``write`` + ``fsync`` of 1 GiB cost the writing process 0.45-4.2 CPU s (the page
cache's allocation, copy and writeback; it moved 3x within an hour), a direct write of the same bytes 0.07-0.08 s
and less wall time (``bench/bench_direct_write.py``; docs/performance.md).  That per-byte kernel cost was most
of what a save's background work cost a training step.

Direct I/O wants each write's memory address, file offset and length to be multiples of the device's block.  A
data file is a safetensors header then the payloads back to back; the stager lays each payload out in the arena at
an address congruent to its file offset (:meth:`ckpt.saving.process_writer.ProcessStager.begin`), so every whole
block of a payload is written straight from the arena.  What is not congruent (the header's block, a payload whose
dtype forbade the congruent address, the last partial block) goes through a small aligned bounce buffer; the file
is padded to a whole block and truncated back to its size.  Every payload is hashed block by block right before it
is written, as :func:`~ckpt.format.streamwrite.write_payloads` does, and the bytes are the same as that writer's.

Torch-free (the writer process imports it).  Where the file system refuses direct I/O the caller writes buffered.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

from .codecs import StreamingChecksum

ALIGN = 4096  # a multiple of every common logical block size (512, 4096); a larger one fails and falls back
BOUNCE = 4 << 20  # the bounce buffer: the header's block, incongruent payloads, the tail
DIRECT_BLOCK = 8 << 20  # bytes per direct write, each hashed right before it is written


# what a file system that cannot do this direct write answers (misaligned for its block, or no direct I/O at all)
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


class DirectIOUnsupported(OSError):
    """The file system (or a block size above :data:`ALIGN`) refused a direct write; nothing is promised about the
    file's contents, which the caller rewrites buffered."""


@dataclass
class DirectStats:
    """How a file's bytes reached the disk: straight from the arena, or through the bounce buffer."""

    direct: int = 0
    bounced: int = 0


def enable_direct(fd: int) -> bool:
    """Turn on ``O_DIRECT`` for the open file ``fd``; False where the platform or file system cannot."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | flag)
    except OSError:
        return False
    return True


def disable_direct(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~getattr(os, "O_DIRECT", 0))


def new_bounce() -> mmap.mmap:
    """A page-aligned bounce buffer (anonymous mappings start on a page)."""
    return mmap.mmap(-1, BOUNCE)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        try:
            n = os.pwrite(fd, data[done:], offset + done)
        except OSError as e:
            if e.errno in _REFUSED:
                raise DirectIOUnsupported(e.errno, f"direct write refused at offset {offset + done}") from e
            raise
        if n <= 0 or n % ALIGN:  # a direct write moves whole blocks; anything else is not one we can continue
            raise DirectIOUnsupported(errno.EINVAL, f"direct write of {len(data) - done} bytes wrote {n}")
        done += n


def write_direct(
    fd: int,
    head: bytes,
    arena: memoryview,
    spans: Sequence[tuple[int, int]],
    bounce: mmap.mmap,
) -> tuple[list[tuple[int, int, str]], int, DirectStats]:
    """Write ``head`` then the arena's ``spans`` (offset, bytes) back to back into ``fd`` (opened with
    ``O_DIRECT``, empty); return ``(offset, nbytes, checksum)`` of each payload, the file size, and the stats.

    ``arena`` must start on a page (an ``mmap``).  Raises :class:`DirectIOUnsupported` when a write is refused."""
    # segments in file order: (file start, bytes, view, arena offset or -1 for the header)
    segs: list[tuple[int, int, memoryview, int]] = [(0, len(head), memoryview(head), -1)]
    pos = len(head)
    for o, n in spans:
        segs.append((pos, n, arena[o : o + n], o))
        pos += n
    size = pos
    hashes = [StreamingChecksum() for _ in spans]
    stats = DirectStats()
    buf = memoryview(bounce)

    def congruent(k: int) -> bool:  # segment k lies in the arena at addresses congruent to its file offsets
        start, _, _, src = segs[k]
        return src >= 0 and (src - start) % ALIGN == 0

    def direct_at(k: int, at: int) -> bool:  # can a whole block at file offset ``at`` of segment k go direct?
        start, n, _, _ = segs[k]
        return at % ALIGN == 0 and start + n - at >= ALIGN and congruent(k)

    f, i = 0, 0
    while f < size:
        while segs[i][0] + segs[i][1] <= f:
            i += 1
        start, n, view, src = segs[i]
        if direct_at(i, f):
            rel = f - start
            take = min((n - rel) // ALIGN * ALIGN, DIRECT_BLOCK)
            block = view[rel : rel + take]
            hashes[i - 1].update(block)
            _pwrite_all(fd, block, f)
            stats.direct += take
            f += take
            continue
        fill, j = 0, i
        while fill < BOUNCE and f + fill < size:
            start, n, view, src = segs[j]
            g = f + fill
            if g >= start + n:
                j += 1
                continue
            if fill and direct_at(j, g):
                break
            rel = g - start
            take = min(start + n - g, BOUNCE - fill)
            if g % ALIGN and congruent(j):
                take = min(take, ALIGN - g % ALIGN)  # stop at the block where this payload can go direct
            piece = view[rel : rel + take]
            if j:
                hashes[j - 1].update(piece)
            buf[fill : fill + take] = piece
            fill += take
        stats.bounced += fill
        whole = -(-fill // ALIGN) * ALIGN
        if whole != fill:  # the file's last block: pad it (truncated below)
            buf[fill:whole] = bytes(whole - fill)
        _pwrite_all(fd, buf[:whole], f)
        f += fill
    if size % ALIGN:
        os.ftruncate(fd, size)
    placed = [(segs[k + 1][0], spans[k][1], h.hexdigest()) for k, h in enumerate(hashes)]
    return placed, size, stats
