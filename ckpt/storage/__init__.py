"""The storage layer: the only code that touches the filesystem or fsspec.

Everything above it speaks in paths relative to a root URL and the primitives of :class:`Storage`: create a file
atomically (optionally create-only), read a byte range, stat, list, delete.  :func:`open_storage` is the one way to
get a :class:`Storage`; it picks the backend from the URL's scheme through :data:`BACKENDS`:

* local paths and ``file://`` -> :class:`~ckpt.storage.local.LocalStorage` (plain ``os`` calls, fsync, link/rename);
* ``s3://`` / ``s3a://`` -> :class:`~ckpt.storage.s3.S3Storage` (create-only PUTs, multipart cleanup);
* any other fsspec URL (``memory://``, ``gs://``, ...) -> :class:`~ckpt.storage.fsspec.FsspecStorage`.

Adding a backend is one module with a :class:`Storage` subclass and one line in :data:`BACKENDS`.  Folders in
foreign formats (HF, DCP, NxD) are published through :func:`ckpt.storage.folder.begin_folder`.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import functools
import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO, NamedTuple

from ckpt.errors import StorageError

from .retry import RETRIES


class Storage(abc.ABC):
    """Primitives on files under one root URL. Instances are cheap; open one per checkpoint root.

    Paths (``rel``) are relative to the root, ``/``-separated; ``""`` is the root itself.  Unless a method says
    otherwise, a missing file raises ``FileNotFoundError`` and any other backend failure (after the retries a
    remote backend makes on transient errors) one :class:`~ckpt.errors.StorageError` line naming the file.
    """

    url: str  # the root as the user gave it (no trailing slash)
    root: str  # the root as the backend names it: path(""), an absolute local path or the fsspec path
    protocol: str  # "file", "s3", "memory", ...
    retries: int = RETRIES  # how often a transient failure is retried (remote backends)
    local = False  # True when files are plain local files: no retries, stat is cheap, mmap works

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, retries: int = RETRIES
    ) -> None:
        self.url = str(url).rstrip("/") or "/"
        self.retries = retries

    # ------------------------------------------------------------------------------------------------ naming
    @abc.abstractmethod
    def path(self, rel: str = "") -> str:
        """The backend's own path of ``rel`` (a local path, or the fsspec path without protocol)."""

    @abc.abstractmethod
    def display(self, rel: str = "") -> str:
        """``rel`` as the user would write it (a local path or a full URL), for messages."""

    def local_path(self, rel: str = "") -> str | None:
        """A real filesystem path of ``rel`` (for callers that want to mmap or hand a path to another library),
        or None when the backend has none."""
        return None

    def child(self, rel: str) -> Storage:
        """A Storage rooted at ``rel`` below this one, sharing the backend's connection and options."""
        sub = copy.copy(self)
        sub.url = f"{self.url}/{rel}"
        sub.root = self.path(rel)
        return sub

    # ------------------------------------------------------------------------------------------------ writing
    @abc.abstractmethod
    def create(
        self, rel: str, exclusive: bool = True, borrow: bool = False
    ) -> contextlib.AbstractContextManager[BinaryIO]:
        """A context manager yielding a write-only binary file (only ``write`` is guaranteed).

        On clean exit the file is published as ``rel`` atomically: a reader sees the old state or the complete
        new file, never a part of it, also after a crash.  An exception inside the block publishes nothing and
        propagates.  ``exclusive`` (create-only) makes the publish raise
        :class:`~ckpt.errors.CheckpointExistsError` when ``rel`` already exists; otherwise ``rel`` is replaced.
        Create-only is atomic against concurrent writers on local disk (``link``) and S3 (``If-None-Match``);
        on other fsspec backends it is a check followed by the write.  Parent folders are created as needed.

        ``borrow``: the caller promises not to change any buffer it passes to ``write`` until the block has
        exited; a backend may then keep a reference instead of a copy (S3 builds each part straight from the
        caller's memory).  Without it, ``write`` behaves like a file's: the buffer may be reused at once.
        """

    def put_bytes(self, rel: str, data: bytes, exclusive: bool = True) -> None:
        """Publish ``data`` as ``rel`` with :meth:`create`'s guarantees."""
        with self.create(rel, exclusive=exclusive) as f:
            f.write(data)

    # ------------------------------------------------------------------------------------------------ reading
    @abc.abstractmethod
    def read_bytes(self, rel: str) -> bytes:
        """The whole file. A folder is a ``StorageError`` (local) or ``FileNotFoundError`` (object stores)."""

    @abc.abstractmethod
    def read_range(self, rel: str, start: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``start``; fewer (a truncated file) is a ``StorageError`` ("short read")."""

    @abc.abstractmethod
    def read_into(
        self, rel: str, start: int, out: memoryview, on_block: Callable[[memoryview], None] | None = None
    ) -> None:
        """Fill all of ``out`` from ``rel`` at ``start`` (zero-copy for local files); short read: ``StorageError``.

        ``on_block`` is called on consecutive slices of ``out`` that together cover it exactly once, each right
        after it is read, while it is still in the CPU cache: hashing there costs no second pass over memory.
        """

    def read_many(
        self, reads: Sequence[Read], on_block: Callable[[int, memoryview], None] | None = None
    ) -> None:
        """Fill every ``reads[i].out`` from ``reads[i].rel`` at ``reads[i].start``; several at once where the
        backend gains from it (ranged GETs in flight on object stores), one after the other on local disk.

        ``on_block(i, block)`` is called, from any thread, on consecutive slices of ``reads[i].out`` that together
        cover it exactly once, in order, each as soon as it is filled: a checksum can be computed while later
        reads are still on the wire.  A failure is a :class:`ReadFailed` carrying the index of the read and the
        error (``FileNotFoundError`` or a ``StorageError`` naming the file); no read is still writing into its
        ``out`` when this returns or raises.
        """
        for i, r in enumerate(reads):
            cb = None if on_block is None else functools.partial(on_block, i)
            try:
                self.read_into(r.rel, r.start, r.out, cb)
            except (OSError, StorageError) as e:
                raise ReadFailed(i, e) from e

    @abc.abstractmethod
    def size(self, rel: str) -> int | None:
        """Size in bytes, or None when there is no file ``rel`` (missing, or a folder)."""

    @abc.abstractmethod
    def exists(self, rel: str) -> bool:
        """Is there a file or a (non-empty, on object stores) folder ``rel``?"""

    @abc.abstractmethod
    def is_dir(self, rel: str = "") -> bool:
        """Is ``rel`` a folder (a prefix with objects under it, on object stores)?"""

    @abc.abstractmethod
    def listdir(self, rel: str = "") -> list[str]:
        """Sorted names (not paths) of the files and folders directly under ``rel``; empty when ``rel`` is
        missing or is a file."""

    # ------------------------------------------------------------------------------------------------ deleting
    @abc.abstractmethod
    def delete(self, rel: str) -> None:
        """Remove the file ``rel``; nothing happens when it is missing."""

    @abc.abstractmethod
    def delete_tree(self, rel: str) -> None:
        """Remove ``rel`` and everything under it (never a sibling that merely shares its name as a prefix);
        nothing happens when it is missing. Not atomic: a crash can leave part of the tree."""

    def abort_stale_uploads(self, rel: str = "", live: Callable[[str], bool] | None = None) -> int:
        """Abort uploads left unfinished (and billed) under ``rel`` by crashed writers; returns how many.
        Only object stores with multipart uploads have any.  ``live(path)`` (the path relative to ``rel``) says
        which may belong to a writer still at work (a later step's save): those are left alone."""
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.display()!r})"


class Read(NamedTuple):
    """One read of :meth:`Storage.read_many`: fill all of ``out`` from file ``rel`` at byte ``start``."""

    rel: str
    start: int
    out: memoryview


class ReadFailed(Exception):
    """:meth:`Storage.read_many` could not fill ``reads[index]``; ``error`` says why (callers turn it into a
    one-line error naming the file and what it holds)."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(f"read {index}: {error}")
        self.index = index
        self.error = error


class Backend(NamedTuple):
    """Where a backend's class lives (``"module:Class"``, imported on first use) and what to install for it."""

    target: str
    install: str = ""  # the pip package the backend needs; "" when fsspec's registry knows it (or none)


# scheme -> backend; every other scheme goes to FsspecStorage. Local paths (no "://") count as "file".
BACKENDS: dict[str, Backend] = {
    "file": Backend("ckpt.storage.local:LocalStorage"),
    "s3": Backend("ckpt.storage.s3:S3Storage", "s3fs"),
    "s3a": Backend("ckpt.storage.s3:S3Storage", "s3fs"),
}
FSSPEC = Backend("ckpt.storage.fsspec:FsspecStorage")


def scheme(url: str) -> str:
    """The URL's scheme, lower case: ``"file"`` for a plain path; the first of a chained ``a::b://`` URL."""
    if "://" not in url:
        return "file"
    return url.split("://", 1)[0].split("::", 1)[0].lower()


#: schemes checked by :func:`refuse_mangled_url` even when fsspec is not importable
_KNOWN_SCHEMES = {
    "s3",
    "s3a",
    "gs",
    "gcs",
    "az",
    "abfs",
    "abfss",
    "adl",
    "hf",
    "http",
    "https",
    "file",
    "memory",
}


def refuse_mangled_url(url: str) -> None:
    """Refuse a plain path that is a URL with a slash missing (``s3:/bucket/run``, ``s3:bucket``).

    Such a string is a valid local path, so without this check a save or an export "succeeds" into a local folder
    named ``s3:``; no URL is ever treated as a local path.
    """
    import re

    if "://" in url:
        return
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", url)
    if m is None:
        return
    name = m.group(1).lower()
    known = name in _KNOWN_SCHEMES
    if not known:
        with contextlib.suppress(ImportError):
            from fsspec.registry import known_implementations

            known = name in known_implementations
    if known:
        rest = url[m.end() :].lstrip("/")
        raise StorageError(
            f"{url}: looks like a {name}:// URL with a slash missing; write {name}://{rest} "
            f"(a local path starting with '{name}:' is refused, so that nothing lands in a folder named '{name}:')"
        )


def open_storage(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, retries: int = RETRIES
) -> Storage:
    """The :class:`Storage` for ``url`` (a local path, ``file://``, ``s3://`` or any fsspec URL).

    ``storage_options`` go to the fsspec filesystem (credentials, ``client_kwargs={"endpoint_url": ...}``);
    ``retries`` is how often a remote backend retries a transient error.  A scheme nobody implements, or whose
    implementation is not installed, is one ``StorageError`` line saying what to install.
    """
    url = str(url)
    refuse_mangled_url(url)
    name = scheme(url)
    backend = BACKENDS.get(name, FSSPEC)
    module, _, cls_name = backend.target.partition(":")
    cls = getattr(importlib.import_module(module), cls_name)
    try:
        return cls(url, storage_options, retries=retries)
    except ImportError as e:
        package = backend.install or _missing_package(name, e)
        raise StorageError(
            f"{url}: the {name}:// scheme needs the package {package!r}, which is not installed "
            f"(pip install {package})"
        ) from None
    except ValueError as e:
        if "Protocol not known" not in str(e):
            raise
        raise StorageError(
            f"{url}: unknown storage scheme {name!r} (expected a local path, file://, s3:// or another "
            "fsspec protocol)"
        ) from None


def _missing_package(name: str, exc: ImportError) -> str:
    """The package to install for scheme ``name``: the module the import failed on, else fsspec's registry."""
    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, ImportError) and e.name:
            return e.name.split(".", 1)[0]
    with contextlib.suppress(ImportError, KeyError):
        from fsspec.registry import known_implementations

        return known_implementations[name]["class"].split(".", 1)[0]
    return f"the fsspec implementation of {name}://"


__all__ = [
    "BACKENDS",
    "FSSPEC",
    "RETRIES",
    "Backend",
    "Read",
    "ReadFailed",
    "Storage",
    "open_storage",
    "scheme",
]
