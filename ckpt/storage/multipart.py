"""Writing one S3 object from memory as a multipart upload, several parts in flight, published whole or not at all.

Why not a spool file and ``put_file``: the bytes of a data file are already in host memory (the staged tensors), so
writing them to a local temp file and reading them back only to upload them costs two passes over memory and a
disk's worth of bandwidth.  :class:`MultipartWriter` builds each part's ``bytes`` body (what S3's client takes)
straight from the buffers the caller wrote when it may borrow them (``create(..., borrow=True)``: data files,
whose staged tensors do not change until the file is published), else from copies, and hands it to one of
``in_flight`` uploader threads while the caller keeps writing, so packing, checksumming and uploading overlap.
Memory held: the parts on the wire (plus, without ``borrow``, copies of the part being filled).

Publication is S3's own: the object appears when ``CompleteMultipartUpload`` (create-only: ``If-None-Match: *``)
succeeds, after every part is in; an object smaller than one part is one create-only PUT.  Any failure (a part
that fails after its retries, an exception in the caller's block, ``KeyboardInterrupt``) waits for the parts still
in flight and then aborts the upload, so nothing is visible and nothing stays billed.  Only an abort that itself
keeps failing leaves the upload open; :meth:`~ckpt.storage.s3.S3Storage.abort_stale_uploads` (run by retention)
sweeps it.

Part sizes grow with the part number (doubling every 1,000 parts, up to S3's 5 GiB) so that a stream of unknown
length fits S3's 10,000-part limit up to well over 5 TiB without knowing its size in advance.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
from typing import TYPE_CHECKING, Any

from ckpt.errors import CheckpointExistsError, StorageError

if TYPE_CHECKING:
    from .fsspec import FsspecStorage

MIN_PART = 5 << 20  # S3's smallest part (all but the last)
MAX_PART = 5 << 30  # S3's largest part
MAX_PARTS = 10_000
GROW_EVERY = 1_000  # parts between doublings of the part size


def part_size(base: int, number: int) -> int:
    """Size of part ``number`` (1-based): ``base``, doubled every :data:`GROW_EVERY` parts, at most 5 GiB.

    With a 16 MiB base, 10,000 parts hold 13 TiB; a file never needs to announce its size first."""
    return min(base << ((number - 1) // GROW_EVERY), MAX_PART)


def multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives an object completed from parts with these ETags: MD5 of their binary MD5s, ``-N``."""
    digest = hashlib.md5(usedforsecurity=False)
    for etag in part_etags:
        digest.update(bytes.fromhex(etag.strip('"')))
    return f'"{digest.hexdigest()}-{len(part_etags)}"'


class MultipartWriter:
    """A write-only binary file that becomes the S3 object ``rel`` on :meth:`finish`, or nothing on :meth:`abort`.

    ``write`` copies its argument (the caller may reuse its buffer at once) unless ``borrow``.  Failures of parts
    already in flight surface at the next ``write`` or at ``finish``; the caller must then call :meth:`abort`
    (``S3Storage.create`` does, on every exception including ``BaseException``).
    """

    def __init__(
        self,
        storage: FsspecStorage,
        rel: str,
        exclusive: bool,
        base_part: int,
        in_flight: int,
        borrow: bool = False,
    ) -> None:
        self.storage = storage
        self.rel = rel
        self.exclusive = exclusive
        self.base_part = base_part
        self.in_flight = max(1, in_flight)
        self.bucket, _, self.key = storage.path(rel).partition("/")
        self.upload_id: str | None = None
        self.borrow = borrow
        self._number = 1  # the part being filled
        # what the part being filled holds: the caller's own buffers (borrow) or copies of them
        self._pieces: list[memoryview | bytes] = []
        self._cap = part_size(base_part, 1)
        self._fill = 0
        self._pending: dict[cf.Future[str], int] = {}  # parts in flight -> part number
        self._etags: dict[int, str] = {}
        self._pool: cf.ThreadPoolExecutor | None = None
        self.state = "open"  # -> "published" | "aborted"

    # ---------------------------------------------------------------------------------------------- the file API
    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        pos = 0
        while pos < n:
            if self._fill == self._cap:  # full, and more follows (a file of exactly one part stays one PUT)
                self._submit()
            take = min(n - pos, self._cap - self._fill)
            piece = view[pos : pos + take]
            self._pieces.append(piece if self.borrow else bytes(piece))
            self._fill += take
            pos += take
        return n

    def writable(self) -> bool:
        return True

    # ---------------------------------------------------------------------------------------------- parts
    def _submit(self) -> None:
        """Hand the part being filled to an uploader; wait for a slot first (at most ``in_flight`` bodies exist)
        and raise the first failure of a finished part."""
        if self.upload_id is None:
            self.upload_id = self._call(
                "starting the upload of", "create_multipart_upload", Bucket=self.bucket, Key=self.key
            )["UploadId"]
            self._pool = cf.ThreadPoolExecutor(self.in_flight, thread_name_prefix="ckpt-s3-part")
        if self._number > MAX_PARTS:
            raise StorageError(f"{self.storage.display(self.rel)}: more than {MAX_PARTS} parts")
        while len(self._pending) >= self.in_flight:
            self._reap(cf.FIRST_COMPLETED)
        # the body as bytes (botocore and aiohttp spend twice the CPU on a bytearray body), joined straight from
        # the caller's memory when borrowed
        body = b"".join(self._pieces)
        self._pieces = []
        assert self._pool is not None
        self._pending[self._pool.submit(self._upload_part, self._number, body)] = self._number
        self._number += 1
        self._cap = part_size(self.base_part, self._number)
        self._fill = 0

    def _upload_part(self, number: int, body: bytes) -> str:
        resp = self._call(
            f"uploading part {number} of",
            "upload_part",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=body,
        )
        return str(resp["ETag"])

    def _reap(self, how: str) -> None:
        """Wait for parts in flight (the first one, or all) and record them; raise the first failure."""
        done, _ = cf.wait(list(self._pending), return_when=how)
        for fut in done:
            self._etags[self._pending.pop(fut)] = fut.result()  # raises the part's StorageError

    def _call(self, what: str, method: str, **kwargs: Any) -> Any:
        s = self.storage
        return s._retry(what, self.rel, lambda: s.fs.call_s3(method, **kwargs))

    # ---------------------------------------------------------------------------------------------- the end
    def finish(self) -> None:
        """Publish: one create-only PUT when everything fits one part, else the last part and the completion."""
        if self.upload_id is None:
            data = b"".join(self._pieces)
            self._pieces = []
            self.storage._put_whole(self.rel, data, self.exclusive)
            self.state = "published"
            return
        if self._fill:
            self._submit()
        while self._pending:
            self._reap(cf.FIRST_EXCEPTION)
        etags = [self._etags[i] for i in range(1, self._number)]
        parts = [{"PartNumber": i, "ETag": e} for i, e in enumerate(etags, 1)]
        match = {"IfNoneMatch": "*"} if self.exclusive else {}
        try:
            self._call(
                "completing the upload of",
                "complete_multipart_upload",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
                **match,
            )
        except (FileExistsError, FileNotFoundError, CheckpointExistsError, StorageError) as e:
            # a lost response to a completion the server applied: the retry finds the upload gone (NoSuchUpload)
            # or the name taken (412); the object is ours when its ETag is the one our parts make
            if not self._holds(etags):
                if isinstance(e, StorageError) and not self.storage._refused_as_existing(e):
                    raise
                if isinstance(e, FileNotFoundError):
                    raise StorageError(
                        f"completing the upload of {self.storage.display(self.rel)} failed: the upload is gone "
                        "(aborted by another process?)"
                    ) from None
                raise CheckpointExistsError(f"{self.storage.display(self.rel)} already exists") from None
        self.state = "published"
        self._close_pool()

    def _holds(self, etags: list[str]) -> bool:
        with contextlib.suppress(OSError, StorageError, KeyError):
            info = self.storage.fs.call_s3("head_object", Bucket=self.bucket, Key=self.key)
            return str(info["ETag"]) == multipart_etag(etags)
        return False

    def abort(self) -> None:
        """Publish nothing: stop queued parts, wait for those in flight, abort the upload (idempotent)."""
        if self.state != "open":
            return
        self.state = "aborted"
        self._pieces = []
        try:
            for fut in self._pending:
                fut.cancel()
            cf.wait(list(self._pending))  # a part still uploading could otherwise land after the abort
            self._pending.clear()
        finally:
            self._close_pool()
            if self.upload_id is not None:
                # a failed abort leaves the upload open (billed, invisible) until retention sweeps it
                with contextlib.suppress(Exception):
                    self._call(
                        "aborting the upload of",
                        "abort_multipart_upload",
                        Bucket=self.bucket,
                        Key=self.key,
                        UploadId=self.upload_id,
                    )

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
