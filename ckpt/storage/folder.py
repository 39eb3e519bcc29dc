"""Publishing a whole folder in a foreign format (HF, DCP, NxD): a folder transaction.

Such a folder is read by tools that know nothing of our manifest, so "complete or absent" must come from the
folder itself.  :func:`begin_folder` refuses a destination that is a file or a non-empty folder/prefix and returns
a :class:`FolderTxn`: write the files through ``txn.storage`` (or, from other processes, through
``open_storage(txn.url, txn.storage_options)``), then ``txn.commit(markers)`` or ``txn.abort()``.

* Local disk: the files go to a hidden ``.<name>.tmp-<id>`` folder next to the destination (same filesystem).
  ``commit`` writes the markers there (create-only), fsyncs every file and folder, renames the temp folder to the
  destination (an existing *empty* destination folder is replaced) and fsyncs the parent.  A reader, and a crash,
  sees nothing or the complete folder with its markers; at worst a hidden temp folder is left behind.
* Object stores (no rename): the files go straight under the destination prefix, which was empty at begin;
  ``commit`` writes the markers last, create-only.  A reader sees files appear one by one and must trust the
  folder only once its marker is there (as DCP's ``.metadata`` and NxD's ``done`` already work).

``abort`` removes everything written (the temp folder, or the whole prefix and any unfinished uploads under it)
and is idempotent; after a successful ``commit`` it does nothing, so ``finally: txn.abort()`` is safe.  Used as a
context manager, a transaction that was not committed when the block ends is aborted.
"""

from __future__ import annotations

import abc
import errno
import os
import shutil
import uuid
from collections.abc import Mapping
from typing import Any

from ckpt.errors import CheckpointExistsError, StorageError

from . import Storage, open_storage
from .local import fsync_dir


class FolderTxn(abc.ABC):
    """An open folder transaction (see the module docstring). Get one from :func:`begin_folder`."""

    destination: str  # where the folder is published, as the user wrote it (for messages)
    url: str  # where its files are written until commit: open_storage(url, storage_options) from any process
    storage: Storage  # open_storage(url, storage_options), for this process
    storage_options: dict[str, Any] | None

    def __init__(self, url: str, storage_options: dict[str, Any] | None, destination: str) -> None:
        self.url = url
        self.storage_options = storage_options
        self.storage = open_storage(url, storage_options)
        self.destination = destination
        self.state = "open"  # -> "committed" | "aborted"

    def commit(self, markers: Mapping[str, bytes] | None = None) -> None:
        """Publish the folder; ``markers`` (name -> bytes, e.g. ``{"done": b""}``) are written last, create-only.

        A marker name that a worker already wrote is a :class:`CheckpointExistsError`.  After a failed commit,
        call :meth:`abort`.
        """
        if self.state != "open":
            raise StorageError(f"{self.destination}: the folder transaction is already {self.state}")
        self._publish(dict(markers or {}))
        self.state = "committed"

    def abort(self) -> None:
        """Remove everything written (idempotent; does nothing after a successful commit)."""
        if self.state == "open":
            self._discard()
            self.state = "aborted"

    @abc.abstractmethod
    def _publish(self, markers: dict[str, bytes]) -> None:
        """Make the folder, with ``markers`` written last, what readers of the destination see."""

    @abc.abstractmethod
    def _discard(self) -> None:
        """Remove everything written so far."""

    def __enter__(self) -> FolderTxn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.destination!r}, {self.state})"


class LocalFolderTxn(FolderTxn):
    """Built in a hidden sibling folder, published by one ``rename``."""

    def __init__(self, final: str, storage_options: dict[str, Any] | None) -> None:
        if os.path.lexists(final) and (not os.path.isdir(final) or os.listdir(final)):
            what = "a non-empty folder" if os.path.isdir(final) else "a file"
            raise CheckpointExistsError(f"{final}: already exists ({what}); choose a new destination")
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:8]}")
        os.mkdir(tmp)
        self.final = final
        super().__init__(tmp, storage_options, final)

    def _publish(self, markers: dict[str, bytes]) -> None:
        tmp = self.url
        _fsync_tree(tmp)
        for name, data in markers.items():
            self.storage.put_bytes(name, data, exclusive=True)  # fsynced, and so is its folder
        try:
            os.rename(tmp, self.final)  # onto an empty folder too; a non-empty one or a file fails
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise CheckpointExistsError(
                    f"{self.final}: appeared while the folder was being written; not published"
                ) from None
            raise StorageError(f"publishing {self.final} failed: {type(e).__name__}: {e}") from e
        fsync_dir(os.path.dirname(self.final))

    def _discard(self) -> None:
        shutil.rmtree(self.url, ignore_errors=True)


class PrefixFolderTxn(FolderTxn):
    """Written in place under a prefix that was empty at begin; the markers, written last, are the commit."""

    def __init__(self, dest: Storage, storage_options: dict[str, Any] | None) -> None:
        if dest.size("") is not None:
            raise CheckpointExistsError(
                f"{dest.display()}: already exists (a file); choose a new destination"
            )
        if dest.listdir():
            raise CheckpointExistsError(
                f"{dest.display()}: already exists (a non-empty folder); choose a new destination"
            )
        super().__init__(dest.url, storage_options, dest.display())

    def _publish(self, markers: dict[str, bytes]) -> None:
        for name, data in markers.items():
            self.storage.put_bytes(name, data, exclusive=True)

    def _discard(self) -> None:
        self.storage.delete_tree("")
        self.storage.abort_stale_uploads()


def begin_folder(url: str, storage_options: dict[str, Any] | None = None) -> FolderTxn:
    """Start publishing a folder at ``url`` (local path or any storage URL); see the module docstring.

    Raises :class:`CheckpointExistsError` when ``url`` is a file or a non-empty folder (prefix).
    """
    dest = open_storage(url, storage_options)
    final = dest.local_path()
    if final is not None:
        return LocalFolderTxn(final, storage_options)
    return PrefixFolderTxn(dest, storage_options)


def _fsync_tree(top: str) -> None:
    """fsync every file and folder under ``top`` (files written by any process, through any API), deepest first."""
    for directory, _, files in os.walk(top, topdown=False):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(directory)
