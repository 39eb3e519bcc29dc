"""File-backed tensors for building one NxD rank: its bytes live in the page cache, not in process memory.

NxD stores one ``torch.save`` file per (tp, pp) rank (and one per DP rank of its ZeRO-1 optimizer), and
``torch.save`` needs every tensor of the file at once, so a writer holds a whole rank: with a fixed TP x PP, a rank
grows with the model (1/8 of a 70B model at TP 4 PP 2 is 35 GB with Adam).  Held in anonymous memory, that is what
a memory cap kills.  :class:`Scratch` allocates the rank's tensors in shared mappings of unlinked temp files instead
(a large tensor one of its own, small ones packed into slabs: small tensors too add up with the model's depth): the kernel can write those pages back and drop them under memory pressure, exactly like
the page cache of the source files, so the process's anonymous memory stays at a few tensors whatever the rank's
size.  ``torch.save`` writes a mapped tensor's bytes like any other (same files byte for byte).  The files live in
the temp folder (``TMPDIR``) and are gone when the tensors are freed; most pages are never written to disk at all.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections.abc import Sequence

import torch

from ckpt.format.datafile import aligned

#: tensors smaller than this stay in ordinary memory (none by default: a rank's many small tensors, e.g. the KV
#: projections' TP slices and their ZeRO-1 shards, add up with the model's depth)
MIN_BYTES = 0
#: small tensors share slabs of this size (one file and mapping each); bigger ones get their own
SLAB_BYTES = 64 << 20


class Scratch:
    """An allocator of file-backed CPU tensors (see the module docstring); :meth:`close` removes its folder.

    Each tensor owns exactly its bytes (``torch.save`` writes a tensor's whole storage): a tensor of a quarter slab
    or more is one shared mapping of its own unlinked file, smaller ones are carved out of a shared 64 MiB slab
    (``torch.frombuffer`` over the slab's ``mmap``: a storage of exactly the tensor's bytes that keeps the slab
    mapped).  A slab is unmapped when its last tensor is freed."""

    def __init__(self, dir: str | None = None, min_bytes: int = MIN_BYTES) -> None:
        self.dir = tempfile.mkdtemp(prefix="ckpt-nxd-rank-", dir=dir)
        self.min_bytes = min_bytes
        self._slab: mmap.mmap | None = None
        self._used = 0

    def _map(self, nbytes: int) -> mmap.mmap:
        """A shared, writable mapping of a new unlinked file of ``nbytes`` in :attr:`dir`."""
        fd, path = tempfile.mkstemp(dir=self.dir)
        try:
            os.unlink(path)  # the mapping keeps the pages; the name is not needed
            os.ftruncate(fd, nbytes)
            return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor that owns exactly its bytes (file-backed unless under ``min_bytes``)."""
        n = 1
        for s in shape:
            n *= int(s)
        nbytes = n * dtype.itemsize
        if nbytes == 0 or nbytes < self.min_bytes:
            return torch.empty(tuple(shape), dtype=dtype)
        if nbytes >= SLAB_BYTES // 4:
            buf, offset = self._map(nbytes), 0
        else:
            offset = aligned(self._used)
            if self._slab is None or offset + nbytes > SLAB_BYTES:
                self._slab, offset = self._map(SLAB_BYTES), 0
            buf = self._slab
            self._used = offset + nbytes
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
        return flat.view(dtype).view(tuple(shape))

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A file-backed copy of ``t`` (contiguous, owning exactly its bytes)."""
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out

    def close(self) -> None:
        self._slab = None  # unmapped when its last tensor goes
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MIN_BYTES", "SLAB_BYTES", "Scratch"]
