"""Which backend errors are worth retrying, and the retry loop every remote backend runs its calls through.

Local files are never retried: an ``OSError`` there is a real answer (no space, no permission), not a hiccup.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from typing import TypeVar

from ckpt.errors import CheckpointExistsError, StorageError

T = TypeVar("T")

RETRIES = 5
FIRST_DELAY = 0.05  # seconds; doubles per attempt (with jitter) up to MAX_DELAY
MAX_DELAY = 5.0

# errno values s3fs gives the OSErrors it translates S3 errors into (s3fs.errors.ERROR_CODE_TO_EXCEPTION):
# InternalError/500 -> EREMOTEIO, SlowDown/ServiceUnavailable/503 -> EBUSY; plus the socket-level ones.
TRANSIENT_ERRNOS = {
    getattr(errno, name)
    for name in ("EREMOTEIO", "EBUSY", "ETIMEDOUT", "ECONNRESET", "ECONNABORTED", "EPIPE", "EAGAIN")
    if hasattr(errno, name)
}
TRANSIENT_CODES = {
    "SlowDown",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
}
# last resort, on the text of the error: what a transient failure of an unknown backend says about itself
TRANSIENT_WORDS = (
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


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions chained under it (``__cause__``, else ``__context__``), without cycles."""
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and all(e is not seen for seen in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _response(e: BaseException) -> tuple[str, int | None] | None:
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code, status if isinstance(status, int) else None


def error_responses(exc: BaseException) -> list[tuple[str, int | None]]:
    """(error code, HTTP status) of every botocore-style error (one with a ``response`` dict) in ``exc``'s chain."""
    return [r for r in map(_response, causes(exc)) if r is not None]


def transient(exc: BaseException) -> bool:
    """Is ``exc`` worth retrying? s3fs translates botocore errors into plain ``OSError(errno, server message)``
    (the S3 error code is lost from the text: a 500 reads "We encountered an internal error"), so look at the
    errno, and at the botocore error kept in the ``__cause__`` chain, not only at the message."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
            return True
        response = _response(e)
        if response is not None:
            code, status = response
            if code in TRANSIENT_CODES or (status is not None and status >= 500):
                return True
    text = f"{type(exc).__name__} {exc}"
    return any(word in text for word in TRANSIENT_WORDS)


def hint(exc: BaseException) -> str:
    """What to do about a failure a user fixes outside ckpt (credentials, permissions); "" when nothing is known."""
    for e in causes(exc):
        name = type(e).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError") or "Unable to locate credentials" in str(
            e
        ):
            return (
                " (no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or pass "
                "storage_options={'key': ..., 'secret': ...}; for an S3-compatible endpoint also set "
                "AWS_ENDPOINT_URL_S3)"
            )
        response = _response(e)
        if isinstance(e, PermissionError) or (
            response is not None and response[0] in ("AccessDenied", "403")
        ):
            return " (access denied: check that these credentials may read and write this bucket and prefix)"
        if response is not None and response[0] in ("InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return " (the credentials were rejected: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the profile)"
    return ""


def with_retries(
    what: str,
    where: str,
    fn: Callable[[], T],
    retries: int = RETRIES,
    before_retry: Callable[[], None] | None = None,
) -> T:
    """``fn()``, retried up to ``retries`` times with exponential backoff and jitter while it fails transiently.

    "Not found" and "already exists" pass through untouched (the caller decides what they mean); a missing file
    reported as ``OSError(ENOENT)`` becomes ``FileNotFoundError(where)``; any other failure, or a transient one
    that outlasts the retries, becomes one ``StorageError`` line: "``what`` ``where`` failed: <type>: <message>".
    ``before_retry`` runs before each new attempt (e.g. to drop a listing cache that may be stale).
    """
    delay = FIRST_DELAY
    for attempt in range(retries + 1):
        try:
            return fn()
        except (FileNotFoundError, FileExistsError, CheckpointExistsError):
            raise
        except Exception as e:  # noqa: BLE001 - classified below
            if not transient(e) or attempt == retries:
                if isinstance(e, OSError) and e.errno == errno.ENOENT:
                    raise FileNotFoundError(where) from e
                raise StorageError(f"{what} {where} failed: {type(e).__name__}: {e}{hint(e)}") from e
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, MAX_DELAY)
            if before_retry is not None:
                before_retry()
    raise AssertionError("unreachable")
