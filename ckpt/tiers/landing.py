"""Where one received file lands: straight into a hidden temp file beside its final name, published only once its
bytes are the sender's.

gloo's ``irecv`` writes into a tensor over a shared mapping of the temp file, so the bytes are written once, where
they stay (no receive buffer, no ``bytes`` copy, no ``write``).  The file is allocated to its full size first
(``posix_fallocate``): a full /dev/shm then fails here, with an error, instead of killing the process with SIGBUS
when gloo touches a page tmpfs cannot back.  After the receive the bytes are hashed in place; only when the digest
is the one the sender hashed is the file flushed, fsynced and renamed to its name (``os.replace``, then the folder
fsynced: :meth:`ckpt.storage.local.LocalStorage.create`'s ``exclusive=False`` guarantees, which the put it
replaces had).  Anything else removes the temp file: no half-received or refused file ever carries the final name.
The temp file is named as ``LocalStorage.create`` names its own (:func:`~ckpt.storage.local.temp_path`): a crash
mid-receive leaves the same kind of hidden leftover as an interrupted put.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import torch

from ..format.codecs import checksum
from ..storage.local import fsync_dir, temp_path


class Landing:
    """A temp file of ``size`` bytes beside ``path``, and ``tensor``, the receive buffer over it.

    When the temp file cannot be made (no space, no folder), ``problem`` says why and ``tensor`` is plain memory:
    the sender's bytes must still be received, or the sender would wait forever; they are then dropped.
    """

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.problem: str | None = None
        self.tmp = Path(temp_path(str(path)))
        self._fd: int | None = None
        self._created = False  # the temp file exists (and is this landing's to remove)
        self._map: mmap.mmap | None = None
        try:
            self.tensor = self._open()
        except OSError as e:
            self.problem = f"{path}: cannot receive: {e.strerror or type(e).__name__}"
            self.discard()
            self.tensor = torch.empty(size, dtype=torch.uint8)

    def _open(self) -> torch.Tensor:
        os.makedirs(self.tmp.parent, exist_ok=True)
        self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        self._created = True
        if not self.size:  # nothing to map (a mapping of 0 bytes is an error)
            return torch.empty(0, dtype=torch.uint8)
        os.posix_fallocate(self._fd, 0, self.size)
        self._map = mmap.mmap(self._fd, self.size, flags=mmap.MAP_SHARED)
        return torch.frombuffer(self._map, dtype=torch.uint8)

    def digest(self) -> str:
        """The xxh3 of what was received, hashed where it lies."""
        if self._map is None:
            return checksum(b"")
        with memoryview(self._map) as view:
            return checksum(view)

    def publish(self, sent: str | None) -> str | None:
        """Rename the temp file to ``path`` when its digest is ``sent`` (the sender's); else remove it.  None when
        published, else one line saying why not.  The receive must be complete (its work waited for)."""
        if self.problem is not None:
            return self.problem
        got = self.digest()
        if sent is None or got != sent:
            self.discard()
            why = "its sender could not read it" if sent is None else f"sent {sent}, got {got}"
            return f"{self.path}: damaged in transit ({why}), not kept"
        try:
            self._unmap()
            assert self._fd is not None
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            os.replace(self.tmp, self.path)
            self._created = False
            fsync_dir(str(self.path.parent))
        except OSError as e:
            self.discard()
            return f"{self.path}: cannot keep: {e.strerror or type(e).__name__}"
        return None

    def _unmap(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            self._map.flush()
            self._map.close()
            self._map = None

    def discard(self, unmap: bool = True) -> None:
        """Remove the temp file (idempotent; never the published file).  ``unmap=False`` when a receive may still
        write into the buffer (an exchange that failed): the mapping then lives on until nothing refers to it."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            if unmap:
                self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)
            self._created = False
