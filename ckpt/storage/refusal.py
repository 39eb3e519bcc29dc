"""A destination that refuses a write (full disk, over quota, read-only, no permission): one line, never a traceback.

Such a failure is the environment's answer, not a bug, so it must read as one ``StorageError`` line naming the
destination, what was being written and why: exit code 2.  Two things hide it on the way up:

* ``torch.save`` (NxD, optimum-neuron and DCP files) reports a failed write as ``RuntimeError: [enforce fail at
  inline_container.cc] unexpected pos``: the ``OSError`` is its ``__context__`` when torch wrote through a Python
  file, and is lost when torch wrote to a path itself.  :func:`naming` finds it in the chain or, failing that, asks
  the folder with one small write of its own (:func:`probe`), and re-raises it as an ``OSError`` naming the file.
* a write's ``OSError`` names no file (``write(2)`` has no path); :func:`naming` adds the file being written.

Writers wrap each file they write in :func:`naming`; the entry point of a whole output (``convert``, a save)
wraps it in :func:`reported`, which turns a refusal into the one line.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import PurePath

from ckpt.errors import StorageError

#: the errors with which storage refuses a write, as the one line says them
REFUSALS: dict[int, str] = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENXIO: "no such bucket",  # an object store's (see refusal_in)
}

#: what torch's zip writer says when a write under it failed (``torch.save`` to a path or a file object)
_TORCH_WRITE = ("inline_container", "PytorchStreamWriter", "cannot be opened", "file write failed")


class WriteRefusedError(StorageError):
    """The destination's storage refused a write (full, over quota, read-only, not permitted); nothing was
    committed.  ``errno`` is the refusal's, ``filename`` the file being written when known."""

    def __init__(self, message: str, errno_: int | None = None, filename: str | None = None) -> None:
        super().__init__(message)
        self.errno = errno_
        self.filename = filename

    def __reduce__(self) -> tuple:  # picklable across worker processes with its fields
        return (type(self), (str(self), self.errno, self.filename))


#: an object store's refusal that s3fs reports as ``FileNotFoundError`` (ENOENT): the bucket is not there
_NO_BUCKET = ("NoSuchBucket", "bucket does not exist")


def refusal_in(exc: BaseException) -> OSError | None:
    """The ``OSError`` refusing a write in ``exc`` or what it was raised from or during, if any (a missing bucket
    comes back as ENXIO, "no such bucket": ENOENT would read as a missing file of ours)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in REFUSALS:
            return e
        if isinstance(e, FileNotFoundError) and any(s in str(e) for s in _NO_BUCKET):
            return OSError(errno.ENXIO, REFUSALS[errno.ENXIO], e.filename)
        e = e.__cause__ or e.__context__
    return None


def probe(directory: str) -> OSError | None:
    """Why ``directory`` refuses writes, found by writing (and removing) a small file there; None if it takes it.

    Used only after torch's writer failed without saying why: the failed file is still there, so a full disk is
    still full.  64 KiB with fsync reaches the device (tmpfs, a quota), not just the page cache."""
    path = os.path.join(directory, f".ckpt-probe-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return e if e.errno in REFUSALS else None
    try:
        os.write(fd, b"\0" * (64 << 10))
        os.fsync(fd)
    except OSError as e:
        return e if e.errno in REFUSALS else None
    finally:
        os.close(fd)
        with suppress(OSError):
            os.unlink(path)
    return None


def _torch_write_failure(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _TORCH_WRITE)


@contextmanager
def naming(path: str) -> Iterator[None]:
    """Around the writing of the local file ``path``: a refusal comes out as ``OSError(errno, strerror, path)``
    (from torch's ``RuntimeError`` too); anything else, and a refusal already naming its file, goes on as it is."""
    try:
        yield
    except Exception as exc:
        cause = refusal_in(exc)
        if cause is None and _torch_write_failure(exc):
            directory = os.path.dirname(path) or "."
            while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
                directory = os.path.dirname(directory)
            cause = probe(directory)
        if cause is None or (exc is cause and cause.filename):
            raise
        raise OSError(cause.errno, os.strerror(cause.errno), cause.filename or path) from exc


def _shown(filename: str | None, dest: str) -> str:
    """``filename`` as the user knows it: relative to ``dest``, the hidden staging folder left out."""
    if not filename:
        return ""
    name = str(filename).removeprefix("file://")
    parts = PurePath(name).parts
    base = PurePath(dest.removeprefix("file://")).name
    for i, part in enumerate(parts):  # staging folders (``.<name>.tmp-<id>``) are not the user's business
        if part == base or part.startswith(f".{base}.tmp-"):
            rest = [p for p in parts[i + 1 :] if not (p.startswith(".") and ".tmp-" in p)]
            if rest:
                return "/".join(rest)
    return name


def _elsewhere(filename: str | None, dest: str) -> bool:
    """``filename`` is known and neither ``dest``, under it, under its staging sibling ``.<name>.tmp-<id>`` nor a
    folder above it (made for it): e.g. a source file that could not be read, not the destination refusing."""
    if not filename or "://" in dest and not dest.startswith("file://"):
        return False
    path = os.path.abspath(str(filename).removeprefix("file://"))
    root = os.path.abspath(dest.removeprefix("file://"))
    staging = os.path.join(os.path.dirname(root), f".{os.path.basename(root)}.tmp-")
    above = root.startswith(path.rstrip(os.sep) + os.sep)
    return not (path == root or above or path.startswith(root + os.sep) or path.startswith(staging))


def reason(exc: BaseException, dest: str) -> str | None:
    """``"no space left on device (<file under dest>)"`` when ``exc`` is storage refusing a write to ``dest``
    (else None)."""
    cause = refusal_in(exc)
    if cause is None or _elsewhere(cause.filename, dest):
        return None
    file = _shown(cause.filename, dest)
    return REFUSALS[cause.errno] + (f" ({file})" if file and file != dest else "")


def refused(exc: BaseException, dest: str, what: str) -> WriteRefusedError | None:
    """The one line for ``exc`` when it is storage refusing a write of ``what`` to ``dest`` (else None)."""
    if isinstance(exc, WriteRefusedError):
        return exc
    why = reason(exc, dest)
    if why is None:
        return None
    cause = refusal_in(exc)
    assert cause is not None
    return WriteRefusedError(
        f"{dest}: cannot write {what}: {why}; nothing was committed", cause.errno, cause.filename
    )


@contextmanager
def reported(dest: str, what: str) -> Iterator[None]:
    """Around the writing of a whole output ``dest``: a refusal becomes :func:`refused`'s one line (after the
    writer below has removed what it wrote); anything else goes on as it is."""
    try:
        yield
    except Exception as exc:
        error = refused(exc, dest, what)
        if error is None or error is exc:
            raise
        raise error from exc


__all__ = ["REFUSALS", "WriteRefusedError", "naming", "probe", "reason", "refusal_in", "refused", "reported"]
