"""The node-local tier for :class:`~ckpt.integrations.lightning.CkptCheckpointIO` (``local_dir=``).

Lightning saves from global rank zero only, so the tiers of :class:`ckpt.CheckpointManager` (collective over every
rank: replicas on peer nodes, agreement at restore) do not apply.  What does: each checkpoint is written to a
node-local folder (NVMe, ``/dev/shm``) by the async writer, then copied to the path Lightning named (a shared file
system or an object store) by a background thread: data files first, ``manifest.json`` last, so the persistent copy
is committed only once whole.  A restart on the same node loads the local copy when it is committed (no read of the
persistent store); a copy failure is raised by the next save or by ``teardown``, as a failed write is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ckpt.format.manifest import MANIFEST_NAME
from ckpt.storage import open_storage


def local_path(local_dir: str, target: str) -> str:
    """Where ``target``'s node-local copy lives: ``<local_dir>/<digest of its folder>/<its name>`` (two
    ModelCheckpoint folders with a ``last.ckpt`` each do not share a copy)."""
    parent, _, name = target.rstrip("/").rpartition("/")
    return os.path.join(local_dir, hashlib.sha1(parent.encode()).hexdigest()[:12], name)


def persist(local: str, target: str, storage_options: dict[str, Any] | None) -> None:
    """Copy the committed folder ``local`` to ``target``, replacing what is there; its manifest last."""
    dst = open_storage(target, storage_options)
    dst.delete(MANIFEST_NAME)  # first: the old checkpoint stops being one before any of its files go
    dst.delete_tree("")
    files = sorted(
        os.path.relpath(os.path.join(d, f), local) for d, _, names in os.walk(local) for f in names
    )
    for rel in [f for f in files if f != MANIFEST_NAME] + [MANIFEST_NAME]:
        dst.put_bytes(rel.replace(os.sep, "/"), Path(local, rel).read_bytes())


class Persister:
    """One background copy at a time: ``start`` after a save, ``wait`` raises the copy's (or the save's) error."""

    def __init__(self, storage_options: dict[str, Any] | None) -> None:
        self.storage_options = storage_options
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, saved: Future, local: str, target: str) -> None:
        self.wait()

        def run() -> None:
            try:
                saved.result()
                persist(local, target, self.storage_options)
            except BaseException as e:  # noqa: BLE001 - raised by wait() on the training thread
                self._error = e

        self._thread = threading.Thread(target=run, name="ckpt-lightning-persist", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error


def drop_local(local: str) -> None:
    shutil.rmtree(local, ignore_errors=True)


__all__ = ["Persister", "drop_local", "local_path", "persist"]
