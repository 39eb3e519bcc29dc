"""Any fsspec URL (``memory://``, ``gs://``, ...): staged writes published by one call, retried reads.

A file is staged (memory for small files, a named local temp file for large ones: :mod:`.spool`) and published
with one ``pipe_file``/``put_file`` call, ``mode="create"`` when create-only (S3 overrides this: it uploads from
memory, :mod:`.multipart`).  We never stream through
``fs.open(path, "wb")``: on object stores an exception inside that context manager still publishes a truncated
object, whereas uploading a finished file in one call never publishes a partial one.  Every call goes through
:func:`~ckpt.storage.retry.with_retries` (transient errors: backoff and retry).  Batches of reads
(:meth:`FsspecStorage.read_many`) go out as a few large ranged reads, several in flight (:mod:`.ranged`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

from ckpt.errors import CheckpointExistsError, StorageError

from . import Read, Storage
from .retry import RETRIES, with_retries
from .spool import SMALL_FILE_BYTES, Spool

MIN_PIECE = 8 << 20  # read_many splits a batch into ranged GETs no smaller than this (read_piece caps it)


class FsspecStorage(Storage):
    """Files under an fsspec URL. ``fs`` is the (cached, shared) fsspec filesystem; ``root`` its path."""

    spool_limit = SMALL_FILE_BYTES  # bytes staged in memory before a file spills to a local temp file
    read_piece = (
        32 << 20
    )  # read_many: adjacent reads are coalesced into ranged GETs of at most this many bytes
    reads_in_flight = 4  # read_many: ranged GETs at once

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, retries: int = RETRIES
    ) -> None:
        import fsspec

        super().__init__(url, storage_options, retries)
        self.fs, root = fsspec.core.url_to_fs(str(url), **(storage_options or {}))
        self.root = root.rstrip("/")
        protocol = self.fs.protocol
        self.protocol = protocol[0] if isinstance(protocol, tuple) else protocol

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def display(self, rel: str = "") -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def _retry(self, what: str, rel: str, fn: Callable[[], Any]) -> Any:
        return with_retries(what, self.display(rel), fn, self.retries, self.fs.invalidate_cache)

    # ------------------------------------------------------------------------------------------------ writing
    @contextlib.contextmanager
    def create(self, rel: str, exclusive: bool = True, borrow: bool = False) -> Iterator[BinaryIO]:
        spool = Spool(self.spool_limit)
        try:
            yield spool  # type: ignore[misc]
            self._publish(rel, spool, exclusive)
        finally:
            spool.close()

    def _publish(self, rel: str, spool: Spool, exclusive: bool) -> None:
        target = self.path(rel)
        if spool.path is None:  # still in memory
            self._put_whole(rel, spool.getvalue(), exclusive)
            return
        spool.flush()
        name = spool.path
        mode = "create" if exclusive else "overwrite"
        self._write_once(
            rel,
            lambda: self.fs.put_file(name, target, mode=mode),
            exclusive,
            lambda: self._holds_file(rel, name),
        )

    def _put_whole(self, rel: str, data: bytes, exclusive: bool) -> None:
        """Publish ``data`` as ``rel`` with one call (one PUT on object stores)."""
        mode = "create" if exclusive else "overwrite"
        target = self.path(rel)
        self._write_once(
            rel,
            lambda: self.fs.pipe_file(target, data, mode=mode),
            exclusive,
            lambda: self._holds_bytes(rel, data),
        )

    def _write_once(
        self, rel: str, fn: Callable[[], Any], exclusive: bool, holds: Callable[[], bool]
    ) -> None:
        """Run the publishing call ``fn`` with retries; "already exists" is success when ``holds()`` (our own
        earlier attempt landed), else :class:`CheckpointExistsError`."""
        try:
            self._retry("writing", rel, fn)
        except (FileExistsError, CheckpointExistsError, StorageError) as e:
            if isinstance(e, StorageError) and not self._refused_as_existing(e):
                raise
            if exclusive and holds():
                return
            raise CheckpointExistsError(f"{self.display(rel)} already exists") from None

    def _refused_as_existing(self, error: StorageError) -> bool:
        """Does a failed write (after retries) mean "the name is taken"? Backends whose create-only refusal is not
        a ``FileExistsError`` say so here."""
        return False

    def _past_the_end(self, error: StorageError) -> bool:
        """Does a failed ranged read mean "the file ends before ``start``" (a short read, not a failure)?
        Backends that refuse such a range instead of returning nothing say so here."""
        return False

    def _holds_bytes(self, rel: str, data: bytes) -> bool:
        """Does ``rel`` already hold exactly the bytes we tried to publish?

        A create-only write whose response is lost (connection reset after the server applied it) is retried by
        the client library or by us, and the retry fails with "already exists" against *our own* object: without
        this check a committed manifest would be reported as a failed, uncommitted save.  Comparing content tells
        that apart from another writer's object (data file names are unique per save attempt; two manifests of
        one step differ in ``created_at`` and file names).  Rare path, so a full read-back is acceptable.
        """
        try:
            return self.read_bytes(rel) == data
        except (OSError, StorageError):
            return False

    def _holds_file(self, rel: str, local_path: str) -> bool:
        """:meth:`_holds_bytes` for bytes staged in the local file ``local_path``, compared block by block."""
        try:
            size = os.path.getsize(local_path)
            if self.size(rel) != size:
                return False
            block = 16 << 20
            with open(local_path, "rb") as local:
                for start in range(0, size, block):
                    if self.read_range(rel, start, min(block, size - start)) != local.read(block):
                        return False
            return True
        except (OSError, StorageError):
            return False

    # ------------------------------------------------------------------------------------------------ reading
    def read_bytes(self, rel: str) -> bytes:
        return self._retry("reading", rel, lambda: self.fs.cat_file(self.path(rel)))

    def read_range(self, rel: str, start: int, length: int) -> bytes:
        if length == 0:
            return b""
        try:
            data = self._retry(
                "reading", rel, lambda: self.fs.cat_file(self.path(rel), start=start, end=start + length)
            )
        except StorageError as e:
            if not self._past_the_end(e):
                raise
            data = b""
        if len(data) != length:
            raise StorageError(
                f"{self.display(rel)}: short read at {start}: got {len(data)} of {length} bytes"
            )
        return data

    def read_into(
        self, rel: str, start: int, out: memoryview, on_block: Callable[[memoryview], None] | None = None
    ) -> None:
        out[:] = self.read_range(rel, start, len(out))
        if on_block is not None:
            on_block(out)

    def read_many(
        self, reads: Sequence[Read], on_block: Callable[[int, memoryview], None] | None = None
    ) -> None:
        from .ranged import plan_pieces, read_pieces

        # as few requests as keep every slot busy: the batch split in reads_in_flight pieces of at least MIN_PIECE
        # and at most read_piece bytes (a piece is held in memory once before it is copied into place)
        total = sum(len(r.out) for r in reads)
        piece = min(self.read_piece, max(MIN_PIECE, -(-total // max(1, self.reads_in_flight))))
        read_pieces(self.read_range, reads, plan_pieces(reads, piece), self.reads_in_flight, on_block)

    def size(self, rel: str) -> int | None:
        try:
            info = self._retry("stat", rel, lambda: self.fs.info(self.path(rel)))
        except FileNotFoundError:
            return None
        return None if info.get("type") == "directory" else int(info["size"])

    def exists(self, rel: str) -> bool:
        return bool(self._retry("stat", rel, lambda: self.fs.exists(self.path(rel))))

    def is_dir(self, rel: str = "") -> bool:
        try:
            return bool(self._retry("stat", rel, lambda: self.fs.isdir(self.path(rel))))
        except FileNotFoundError:
            return False

    def listdir(self, rel: str = "") -> list[str]:
        base = self.path(rel).rstrip("/")
        try:
            entries = self._retry("listing", rel, lambda: self.fs.ls(base, detail=False, refresh=True))
        except FileNotFoundError:
            return []
        names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != base}
        return sorted(names)

    # ------------------------------------------------------------------------------------------------ deleting
    def delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._retry("deleting", rel, lambda: self.fs.rm_file(self.path(rel)))

    def delete_tree(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._retry("deleting", rel, lambda: self.fs.rm(self.path(rel), recursive=True))
