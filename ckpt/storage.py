"""The storage layer: the only module that touches the filesystem or fsspec.

Everything above it speaks in paths relative to a checkpoint root and a handful of primitives: create a file
atomically (optionally create-only), read a byte range, list, delete.  Two backends:

* local paths / ``file://``: plain ``os`` calls. A file is written to a temp name in the destination directory,
  fsynced, then published by ``link`` (create-only: fails if the name exists) or ``replace``, and the directory
  is fsynced, so a crash leaves either the old state or the complete new file.
* any other fsspec URL (``s3://``, ``memory://``, ...): a file is staged (memory for small files, a local temp
  file for large ones) and published with one ``pipe_file``/``put_file`` call, ``mode="create"`` when
  create-only.  S3 has no rename and an exception inside ``with fs.open(p, "wb")`` would still publish a
  truncated object (see docs/storage.md); uploading a finished file in one call never publishes a partial one,
  and s3fs aborts its multipart upload on error.  Transient errors are retried with exponential backoff.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import random
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar

from .errors import CheckpointExistsError, StorageError

T = TypeVar("T")

SMALL_FILE_BYTES = 8 << 20
READ_BLOCK = 4 << 20
RETRIES = 5


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _strip_file(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


# errno values s3fs gives the OSErrors it translates S3 errors into (s3fs.errors.ERROR_CODE_TO_EXCEPTION):
# InternalError/500 -> EREMOTEIO, SlowDown/ServiceUnavailable/503 -> EBUSY; plus the socket-level ones.
_TRANSIENT_ERRNOS = {
    getattr(errno, name)
    for name in ("EREMOTEIO", "EBUSY", "ETIMEDOUT", "ECONNRESET", "ECONNABORTED", "EPIPE", "EAGAIN")
    if hasattr(errno, name)
}
_TRANSIENT_CODES = {
    "SlowDown",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
}


def _transient(exc: BaseException) -> bool:
    """Is ``exc`` worth retrying? s3fs translates botocore errors into plain ``OSError(errno, server message)``
    (the S3 error code is lost from the text: a 500 reads "We encountered an internal error"), so look at the
    errno, and at the botocore error kept in the ``__cause__`` chain, not only at the message."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _TRANSIENT_CODES or (isinstance(status, int) and status >= 500):
                return True
        e = e.__cause__ or e.__context__
    text = f"{type(exc).__name__} {exc}"
    return any(
        s in text
        for s in (
            "SlowDown",
            "503",
            "500",
            "InternalError",
            "ServiceUnavailable",
            "RequestTimeout",
            "Connection",
            "reset",
            "Timeout",
            "EndpointConnectionError",
            "ServerDisconnected",
        )
    )


class Storage:
    """Primitives on files under one root URL. Instances are cheap; create one per checkpoint root."""

    def __init__(
        self, root: str, storage_options: dict[str, Any] | None = None, retries: int = RETRIES
    ) -> None:
        root = str(root)
        self.url = root.rstrip("/") or "/"
        self.local = _is_local(root)
        self.retries = retries
        if self.local:
            self.root = os.path.abspath(_strip_file(root))
            self.fs = None
        else:
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(root, **(storage_options or {}))
            self.root = self.root.rstrip("/")
        self.protocol = (
            "file"
            if self.local
            else self.fs.protocol[0]
            if isinstance(self.fs.protocol, tuple)
            else self.fs.protocol
        )

    # ------------------------------------------------------------------------------------------------ helpers
    def path(self, rel: str = "") -> str:
        """Backend path of ``rel`` (a local path, or the fsspec path without protocol)."""
        if not rel:
            return self.root
        return os.path.join(self.root, rel) if self.local else f"{self.root}/{rel}"

    def display(self, rel: str = "") -> str:
        """The path as the user would write it, for messages."""
        if self.local:
            return self.path(rel)
        return f"{self.url}/{rel}" if rel else self.url

    def child(self, rel: str) -> Storage:
        """A Storage rooted at ``rel`` below this one, sharing the filesystem object."""
        sub = object.__new__(Storage)
        sub.__dict__.update(self.__dict__)
        sub.url = f"{self.url}/{rel}"
        sub.root = self.path(rel)
        return sub

    def _retry(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        delay = 0.05
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except (FileNotFoundError, FileExistsError, CheckpointExistsError):
                raise
            except Exception as e:  # noqa: BLE001 - classified below
                if self.local or not _transient(e) or attempt == self.retries:
                    if isinstance(e, OSError) and e.errno == errno.ENOENT:
                        raise FileNotFoundError(self.display(rel)) from e
                    raise StorageError(f"{what} {self.display(rel)} failed: {type(e).__name__}: {e}") from e
                time.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 5.0)
                if self.fs is not None:
                    self.fs.invalidate_cache()
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------------------ writing
    @contextlib.contextmanager
    def create(self, rel: str, exclusive: bool = True) -> Iterator[BinaryIO]:
        """Yield a binary file; on clean exit publish it as ``rel`` atomically, on exception publish nothing.

        ``exclusive`` makes the publish fail with :class:`CheckpointExistsError` when ``rel`` already exists.
        """
        if self.local:
            final = self.path(rel)
            directory = os.path.dirname(final)
            os.makedirs(directory, exist_ok=True)
            tmp = os.path.join(directory, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:12]}")
            f = open(tmp, "xb", buffering=0)  # noqa: SIM115 - closed below on every path
            try:
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
                _fsync_dir(directory)
            except BaseException:
                f.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            return
        spool = _Spool(SMALL_FILE_BYTES)
        try:
            yield spool  # type: ignore[misc]
            self._publish(rel, spool, exclusive)
        finally:
            spool.close()

    def _publish(self, rel: str, spool: _Spool, exclusive: bool) -> None:
        mode = "create" if exclusive else "overwrite"
        target = self.path(rel)
        if spool.path is None:  # still in memory
            data = spool.getvalue()
            fn: Callable[[], Any] = lambda: self.fs.pipe_file(target, data, mode=mode)  # noqa: E731
        else:
            spool.flush()
            name = spool.path
            fn = lambda: self.fs.put_file(name, target, mode=mode)  # noqa: E731
        try:
            self._retry("writing", rel, fn)
        except (FileExistsError, CheckpointExistsError):
            if exclusive and self._holds(rel, spool):
                return
            raise CheckpointExistsError(f"{self.display(rel)} already exists") from None
        except StorageError as e:
            if "PreconditionFailed" in str(e) or "412" in str(e):
                if exclusive and self._holds(rel, spool):
                    return
                raise CheckpointExistsError(f"{self.display(rel)} already exists") from None
            raise

    def _holds(self, rel: str, spool: _Spool) -> bool:
        """Does ``rel`` already hold exactly the bytes we tried to publish?

        A create-only PUT whose response is lost (connection reset after the server applied it) is retried by
        botocore, s3fs or us, and the retry fails with "already exists" against *our own* object: without this
        check a committed manifest would be reported as a failed, uncommitted save.  Comparing content tells that
        apart from another writer's object (data file names are unique per save attempt; two manifests of one step
        differ in ``created_at`` and file names).  Rare path, so a full read-back is acceptable.
        """
        try:
            if spool.path is None:
                return self.read_bytes(rel) == spool.getvalue()
            size = os.path.getsize(spool.path)
            if self.size(rel) != size:
                return False
            block = 16 << 20
            with open(spool.path, "rb") as local:
                for start in range(0, size, block):
                    if self.read_range(rel, start, min(block, size - start)) != local.read(block):
                        return False
            return True
        except (OSError, StorageError):
            return False

    def put_bytes(self, rel: str, data: bytes, exclusive: bool = True) -> None:
        with self.create(rel, exclusive=exclusive) as f:
            f.write(data)

    # ------------------------------------------------------------------------------------------------ reading
    def read_bytes(self, rel: str) -> bytes:
        if self.local:
            try:
                with open(self.path(rel), "rb") as f:
                    return f.read()
            except IsADirectoryError:
                raise StorageError(f"{self.path(rel)} is a directory, expected a file") from None
        return self._retry("reading", rel, lambda: self.fs.cat_file(self.path(rel)))

    def read_range(self, rel: str, start: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``start``; a short read (truncated file) is an error."""
        if length == 0:
            return b""
        if self.local:
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
                data = parts[0] if len(parts) == 1 else b"".join(parts)
            finally:
                os.close(fd)
        else:
            data = self._retry(
                "reading", rel, lambda: self.fs.cat_file(self.path(rel), start=start, end=start + length)
            )
        if len(data) != length:
            raise StorageError(
                f"{self.display(rel)}: short read at {start}: got {len(data)} of {length} bytes"
            )
        return data

    def read_into(
        self, rel: str, start: int, out: memoryview, on_block: Callable[[memoryview], None] | None = None
    ) -> None:
        """Fill ``out`` from ``rel`` at ``start`` (zero-copy for local files).

        ``on_block`` sees each block right after it is read, while it is still in the CPU cache: hashing there
        costs no second pass over memory.
        """
        if not self.local:
            out[:] = self.read_range(rel, start, len(out))
            if on_block is not None:
                on_block(out)
            return
        fd = os.open(self.path(rel), os.O_RDONLY)
        try:
            done = 0
            while done < len(out):
                block = out[done : done + READ_BLOCK]
                got = 0
                while got < len(block):
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
        """Size in bytes, or None when the file does not exist."""
        if self.local:
            try:
                return os.stat(self.path(rel)).st_size
            except (FileNotFoundError, NotADirectoryError):
                return None
        try:
            info = self._retry("stat", rel, lambda: self.fs.info(self.path(rel)))
        except FileNotFoundError:
            return None
        return None if info.get("type") == "directory" else int(info["size"])

    def exists(self, rel: str) -> bool:
        if self.local:
            return os.path.exists(self.path(rel))
        return bool(self._retry("stat", rel, lambda: self.fs.exists(self.path(rel))))

    def is_dir(self, rel: str = "") -> bool:
        if self.local:
            return os.path.isdir(self.path(rel))
        try:
            return bool(self._retry("stat", rel, lambda: self.fs.isdir(self.path(rel))))
        except FileNotFoundError:
            return False

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly under ``rel``; empty when it does not exist."""
        if self.local:
            try:
                return sorted(os.listdir(self.path(rel)))
            except (FileNotFoundError, NotADirectoryError):
                return []
        base = self.path(rel).rstrip("/")
        try:
            entries = self._retry("listing", rel, lambda: self.fs.ls(base, detail=False, refresh=True))
        except FileNotFoundError:
            return []
        names = []
        for e in entries:
            e = e.rstrip("/")
            if e != base:
                names.append(e.rsplit("/", 1)[-1])
        return sorted(set(names))

    # ------------------------------------------------------------------------------------------------ deleting
    def delete(self, rel: str) -> None:
        if self.local:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(rel))
            return
        with contextlib.suppress(FileNotFoundError):
            self._retry("deleting", rel, lambda: self.fs.rm_file(self.path(rel)))

    def delete_tree(self, rel: str) -> None:
        if self.local:
            import shutil

            shutil.rmtree(self.path(rel), ignore_errors=True)
            return
        with contextlib.suppress(FileNotFoundError):
            self._retry("deleting", rel, lambda: self.fs.rm(self.path(rel), recursive=True))

    def abort_stale_uploads(self, rel: str = "") -> int:
        """Abort unfinished S3 multipart uploads under ``rel``; returns how many. No-op elsewhere."""
        if self.protocol not in ("s3", "s3a"):
            return 0
        bucket, _, key = self.path(rel).partition("/")
        prefix = key.rstrip("/") + "/" if key else ""
        client_call = self.fs.call_s3
        resp = client_call("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        n = 0
        for up in resp.get("Uploads", []):
            client_call("abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
            n += 1
        return n


class _Spool:
    """A write-only staging file: in memory up to ``max_size`` bytes, then a *named* local temporary file.

    (Not ``tempfile.SpooledTemporaryFile``: on Linux it rolls over into an unnamed ``O_TMPFILE`` whose ``name``
    is an int file descriptor, which ``put_file`` cannot upload.)
    """

    def __init__(self, max_size: int) -> None:
        self._max = max_size
        self._mem: io.BytesIO | None = io.BytesIO()
        self._file: BinaryIO | None = None
        self.path: str | None = None

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
        assert self._mem is not None
        return self._mem.getvalue()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._mem = None


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
