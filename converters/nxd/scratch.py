"""File-backed tensors for building one NxD rank: its bytes live in the page cache, not in process memory.

NxD stores one ``torch.save`` file per (tp, pp) rank (and one per DP rank of its ZeRO-1 optimizer), and
``torch.save`` needs every tensor of the file at once, so a writer holds a whole rank: with a fixed TP x PP, a rank
grows with the model (1/8 of a 70B model at TP 4 PP 2 is 35 GB with Adam).  Held in anonymous memory, that is what
a memory cap kills.  :class:`Scratch` allocates each large tensor of the rank in its own shared mapping of an
unlinked temp file instead: the kernel can write those pages back and drop them under memory pressure, exactly like
the page cache of the source files, so the process's anonymous memory stays at a few tensors whatever the rank's
size.  ``torch.save`` writes a mapped tensor's bytes like any other (same files byte for byte).  The files live in
the temp folder (``TMPDIR``) and are gone when the tensors are freed; most pages are never written to disk at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence

import torch

#: tensors smaller than this stay in ordinary memory (a file and a mapping each would cost more than they save)
MIN_BYTES = 1 << 20


class Scratch:
    """An allocator of file-backed CPU tensors (see the module docstring); :meth:`close` removes its folder."""

    def __init__(self, dir: str | None = None, min_bytes: int = MIN_BYTES) -> None:
        self.dir = tempfile.mkdtemp(prefix="ckpt-nxd-rank-", dir=dir)
        self.min_bytes = min_bytes

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor that owns exactly its bytes (file-backed when it is large)."""
        n = 1
        for s in shape:
            n *= int(s)
        nbytes = n * dtype.itemsize
        if nbytes < self.min_bytes:
            return torch.empty(tuple(shape), dtype=dtype)
        fd, path = tempfile.mkstemp(dir=self.dir)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        try:
            storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
        finally:
            os.unlink(path)  # the mapping keeps the pages; the name is not needed
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A file-backed copy of ``t`` (contiguous, owning exactly its bytes)."""
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MIN_BYTES", "Scratch"]
