"""S3 (``s3://``, ``s3a://``) through s3fs: the fsspec backend plus what S3 alone has.

* Create-only is ``If-None-Match: *`` on the PUT (or on CompleteMultipartUpload), atomic against concurrent
  writers.  s3fs reports the refusal as ``FileExistsError`` when S3 names the failed condition; a bare
  ``412 PreconditionFailed`` (some S3-compatible stores) is recognised here from the botocore error s3fs chains.
* Multipart uploads left open by a crashed writer are invisible but billed: :meth:`S3Storage.abort_stale_uploads`
  aborts them (retention calls it).
* Files are uploaded from memory (:mod:`.multipart`): ``part_size`` parts, ``parts_in_flight`` at once, completed
  create-only when every part is in, aborted on any failure; a file smaller than one part is one PUT.  Reads in
  batches are ranged GETs, ``reads_in_flight`` at once (:mod:`.ranged`).  The storage option ``max_concurrency``
  (s3fs's own: transfers in flight per file) sets both; the default is 4.
* s3fs itself is imported by fsspec on first use, so ``import ckpt`` does not need it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from ckpt.errors import StorageError

from .fsspec import FsspecStorage
from .multipart import MultipartWriter
from .retry import RETRIES, causes, error_responses


def precondition_failed(exc: BaseException) -> bool:
    """Is ``exc`` (or an error chained under it) S3's answer to a failed create-only condition?

    Looks at the botocore error's code and status, not at the message: a message names the key, and a key may
    well contain "412" (``step_00000412/...``).
    """
    if any(code == "PreconditionFailed" or status == 412 for code, status in error_responses(exc)):
        return True
    # the backend's own errors (botocore's text carries the code); not our StorageError, whose text has the key
    return any("PreconditionFailed" in str(e) for e in causes(exc) if not isinstance(e, StorageError))


class S3Storage(FsspecStorage):
    """Files under ``s3://bucket/prefix``; ``fs`` is an ``s3fs.S3FileSystem``."""

    part_size = 32 << 20  # the first 1,000 parts; later ones grow (multipart.part_size)
    parts_in_flight = 4

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, retries: int = RETRIES
    ) -> None:
        super().__init__(url, storage_options, retries)
        concurrency = (storage_options or {}).get("max_concurrency")
        if concurrency is not None:
            if int(concurrency) < 1:
                raise StorageError(f"{url}: storage option max_concurrency={concurrency!r}: expected >= 1")
            self.parts_in_flight = self.reads_in_flight = int(concurrency)

    @contextlib.contextmanager
    def create(self, rel: str, exclusive: bool = True, borrow: bool = False) -> Iterator[BinaryIO]:
        writer = MultipartWriter(self, rel, exclusive, self.part_size, self.parts_in_flight, borrow)
        try:
            yield writer  # type: ignore[misc]
            writer.finish()
        except BaseException:
            writer.abort()
            raise

    def _refused_as_existing(self, error: StorageError) -> bool:
        return precondition_failed(error)

    def _past_the_end(self, error: StorageError) -> bool:
        # S3 answers a range starting at or past the end with 416 InvalidRange
        return any(code == "InvalidRange" or status == 416 for code, status in error_responses(error))

    def open_uploads(self, rel: str = "") -> list[tuple[str, str]]:
        """(key, upload id) of every unfinished multipart upload under ``rel``."""
        bucket, _, key = self.path(rel).partition("/")
        prefix = key.rstrip("/") + "/" if key else ""
        out: list[tuple[str, str]] = []
        markers: dict[str, str] = {}
        while True:
            resp = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
            out.extend((up["Key"], up["UploadId"]) for up in resp.get("Uploads", []))
            if not resp.get("IsTruncated"):
                return out
            markers = {"KeyMarker": resp["NextKeyMarker"], "UploadIdMarker": resp["NextUploadIdMarker"]}

    def abort_stale_uploads(self, rel: str = "", live: Callable[[str], bool] | None = None) -> int:
        bucket, _, base = self.path(rel).partition("/")
        base = base.rstrip("/") + "/" if base else ""
        uploads = [(k, u) for k, u in self.open_uploads(rel) if live is None or not live(k[len(base) :])]
        for key, upload_id in uploads:
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        return len(uploads)
