"""One file to send to peer ranks, mapped rather than read: the send costs no copy of the file on the host.

The file (in /dev/shm for the memory tier, in the page cache right after a save otherwise) is mapped
copy-on-write (``MAP_PRIVATE``): :func:`torch.frombuffer` wants a writable buffer, and a private mapping is one
without copying a byte (nothing writes to it, so no page is ever copied).  gloo's ``isend`` then reads the pages
where they lie, and the sender's digest is hashed from the same mapping.

A file that cannot be read or has another size than the manifest says still sends that many zeros, so the
receiver, which waits for exactly that many bytes, never hangs; its digest is then None, which no receiver accepts.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

from ..format.codecs import checksum


class Outgoing:
    """``path``'s bytes as a uint8 tensor to send (``tensor``), and their xxh3 (``digest``, None when the file could
    not be sent as the manifest describes it: ``problem`` says why).  Close it once every send of it completed."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.problem: str | None = None
        self.digest: str | None = None
        self._map: mmap.mmap | None = None
        self.tensor = self._open()

    def _open(self) -> torch.Tensor:
        try:
            with open(self.path, "rb") as f:
                got = os.fstat(f.fileno()).st_size
                if got != self.size:
                    self.problem = f"{self.path}: {got} bytes, the manifest says {self.size}"
                    return torch.zeros(self.size, dtype=torch.uint8)
                if self.size:
                    self._map = mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_COPY)
        except OSError as e:
            self.problem = f"{self.path}: cannot read: {e.strerror or type(e).__name__}"
            return torch.zeros(self.size, dtype=torch.uint8)
        if self._map is None:
            self.digest = checksum(b"")
            return torch.empty(0, dtype=torch.uint8)
        with memoryview(self._map) as view:
            self.digest = checksum(view)
        return torch.frombuffer(self._map, dtype=torch.uint8)

    def close(self) -> None:
        """Unmap the file; the tensor must no longer be in use (its sends waited for)."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            self._map.close()
            self._map = None
