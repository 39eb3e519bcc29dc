"""Local disk (plain paths and ``file://``): ``os`` calls, durable and atomic.

A file is written to ``.<name>.tmp-<id>`` in its destination folder, fsynced, then published by ``link``
(create-only: fails if the name exists) or ``replace``, and the folder is fsynced: a crash leaves either the old
state or the complete new file (plus, at worst, a hidden temp file that retention sweeps).  Nothing is retried:
a local ``OSError`` is an answer (no space, no permission), not a hiccup.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from ckpt.errors import CheckpointExistsError, StorageError

from . import Storage
from .refusal import naming
from .retry import RETRIES

READ_BLOCK = 4 << 20  # read_into's block: small enough to hash while still in the CPU cache


def fsync_dir(directory: str) -> None:
    """Make the names in ``directory`` durable (a new or renamed entry is not, until its folder is fsynced)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(final: str) -> str:
    """The hidden temp file a write of ``final`` goes to before its rename: ``.<name>.tmp-<id>`` beside it, so an
    interrupted write leaves a dot-file no listing of checkpoints mistakes for data."""
    directory, name = os.path.split(final)
    return os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:12]}")


class LocalStorage(Storage):
    """Files under a local folder (which need not exist yet: :meth:`create` makes it)."""

    local = True
    protocol = "file"

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, retries: int = RETRIES
    ) -> None:
        super().__init__(url, storage_options, retries)
        self.root = os.path.abspath(str(url).removeprefix("file://"))

    def path(self, rel: str = "") -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def display(self, rel: str = "") -> str:
        return self.path(rel)

    def local_path(self, rel: str = "") -> str:
        return self.path(rel)

    # ------------------------------------------------------------------------------------------------ writing
    @contextlib.contextmanager
    def create(self, rel: str, exclusive: bool = True, borrow: bool = False) -> Iterator[BinaryIO]:
        final = self.path(rel)
        with naming(final):  # a full disk, a read-only folder: an OSError naming this file, torch's included
            directory = os.path.dirname(final)
            os.makedirs(directory, exist_ok=True)
            tmp = temp_path(final)
            f = open(tmp, "xb", buffering=0)  # noqa: SIM115 - closed below on every path
        try:
            with naming(final):
                yield f
                os.fsync(f.fileno())
                f.close()
                if exclusive:
                    try:
                        os.link(tmp, final)
                    except FileExistsError:
                        raise CheckpointExistsError(f"{final} already exists") from None
                    os.unlink(tmp)
                else:
                    os.replace(tmp, final)
                fsync_dir(directory)
        except BaseException:
            f.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    # ------------------------------------------------------------------------------------------------ reading
    def read_bytes(self, rel: str) -> bytes:
        try:
            with open(self.path(rel), "rb") as f:
                return f.read()
        except IsADirectoryError:
            raise StorageError(f"{self.path(rel)} is a directory, expected a file") from None

    def read_range(self, rel: str, start: int, length: int) -> bytes:
        if length == 0:
            return b""
        # one pread returns at most 0x7ffff000 bytes on Linux: loop, or a shard over 2 GiB reads "short"
        fd = os.open(self.path(rel), os.O_RDONLY)
        try:
            parts: list[bytes] = []
            got = 0
            while got < length:
                part = os.pread(fd, length - got, start + got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
        finally:
            os.close(fd)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if len(data) != length:
            raise StorageError(f"{self.path(rel)}: short read at {start}: got {len(data)} of {length} bytes")
        return data

    def read_into(
        self, rel: str, start: int, out: memoryview, on_block: Callable[[memoryview], None] | None = None
    ) -> None:
        fd = os.open(self.path(rel), os.O_RDONLY)
        try:
            done = 0
            while done < len(out):
                block = out[done : done + READ_BLOCK]
                got = 0
                while got < len(block):  # preadv is capped like pread: loop
                    n = os.preadv(fd, [block[got:]], start + done + got)
                    if n <= 0:
                        raise StorageError(
                            f"{self.path(rel)}: short read at {start + done + got}: file is truncated"
                        )
                    got += n
                if on_block is not None:
                    on_block(block)
                done += got
        finally:
            os.close(fd)

    def size(self, rel: str) -> int | None:
        try:
            st = os.stat(self.path(rel))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return None if stat.S_ISDIR(st.st_mode) else st.st_size

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def is_dir(self, rel: str = "") -> bool:
        return os.path.isdir(self.path(rel))

    def listdir(self, rel: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    # ------------------------------------------------------------------------------------------------ deleting
    def delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(rel))

    def delete_tree(self, rel: str) -> None:
        target = self.path(rel)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target, ignore_errors=True)
        else:
            self.delete(rel)
