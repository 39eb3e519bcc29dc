"""Where a file bound for an object store is staged before its one-call upload: memory, then a local temp file."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from typing import BinaryIO

SMALL_FILE_BYTES = 8 << 20  # files up to this size are uploaded from memory (one PUT, no temp file)


class Spool:
    """A write-only staging file: in memory up to ``max_size`` bytes, then a *named* local temporary file.

    (Not ``tempfile.SpooledTemporaryFile``: on Linux it rolls over into an unnamed ``O_TMPFILE`` whose ``name``
    is an int file descriptor, which ``put_file`` cannot upload.)
    """

    def __init__(self, max_size: int = SMALL_FILE_BYTES) -> None:
        self._max = max_size
        self._mem: io.BytesIO | None = io.BytesIO()
        self._file: BinaryIO | None = None
        self.path: str | None = None  # the temp file, once the data outgrew memory

    def write(self, data: bytes | memoryview) -> int:
        n = memoryview(data).nbytes
        if self._mem is not None and self._mem.tell() + n > self._max:
            fd, self.path = tempfile.mkstemp(prefix="ckpt-upload-")
            self._file = os.fdopen(fd, "wb")
            self._file.write(self._mem.getbuffer())
            self._mem = None
        if self._file is not None:
            self._file.write(data)
        else:
            assert self._mem is not None
            self._mem.write(data)
        return n

    def getvalue(self) -> bytes:
        """The staged bytes (only while they are still in memory: ``path`` is None)."""
        assert self._mem is not None
        return self._mem.getvalue()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Drop the staged data and remove the temp file (idempotent)."""
        if self._file is not None:
            self._file.close()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._mem = None
