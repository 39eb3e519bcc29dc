"""``CkptCheckpointIO``: Lightning's checkpoints written in ckpt's format, in the background, nothing else to change.

Usage::

    from ckpt.integrations.lightning import CkptCheckpointIO

    trainer = Trainer(plugins=[CkptCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="path/to/epoch=1-step=8.ckpt")   # after a crash: resume from ours

Why a ``CheckpointIO``: Lightning's strategies hand it the whole checkpoint dict on global rank zero (DDP replicas
are equal; FSDP with the default ``state_dict_type="full"`` gathers it there first), so this is the one place to
change how Lightning writes.  Each ``.ckpt`` path becomes one of our checkpoint folders, written by
:class:`ckpt.Checkpointer` with ``async_save=True``: ``save_checkpoint`` returns once the tensors are copied to host
memory, and hashing and writing the files overlap the next steps (no ``AsyncCheckpointIO`` wrapper needed; one save
is in flight at a time, the next save waits for it).  ``teardown`` (end of ``fit``) waits for the last write and
raises its error; a failed background write also fails the next save, never silently.

What is stored (:mod:`.lightning_state`): the module's tensors as model tensors, optimizer moments as optimizer
tensors, everything else (loops, callbacks, lr_schedulers, hyper_parameters, ...) as JSON in ``extra.lightning``:
``load_checkpoint`` rebuilds Lightning's dict exactly and unpickles nothing.  A Lightning ``.ckpt`` *file* (a run
saved before the plugin) is still loaded, through :mod:`ckpt.safe_unpickle`'s allow-list.

FSDP (not tested: it needs a GPU; docs/guide.md says why): with ``state_dict_type="full"`` (the default) Lightning
hands this plugin the dict gathered on rank zero; its ``FSDPStrategy.load_checkpoint`` reads a full checkpoint with
``torch.load`` itself, bypassing any ``CheckpointIO``, so an FSDP run would resume from ours after ``ckpt convert
SRC DST.ckpt --format lightning``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError:  # pragma: no cover - the integration needs Lightning
    try:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
    except ImportError as exc:
        raise ImportError("ckpt.integrations.lightning needs Lightning: pip install lightning") from exc

import torch
import torch.distributed as dist

from ckpt.distributed import SELF
from ckpt.errors import CkptError
from ckpt.format.manifest import MANIFEST_NAME
from ckpt.format.reader import CheckpointReader
from ckpt.saving.checkpointer import Checkpointer
from ckpt.saving.options import SaveOptions
from ckpt.state.training import NamedTensor
from ckpt.storage import open_storage

from .lightning_state import EXTRA_KEY, join, optimizer_tree, split
from .lightning_tier import Persister, drop_local, local_path

__all__ = ["CkptCheckpointIO", "load_lightning"]


class _RankZeroCheckpointer(Checkpointer):
    """A checkpointer of this process alone (Lightning calls its ``CheckpointIO`` on global rank zero only: a
    collective would wait for ranks that never come), whose "optimizer" is Lightning's list of state dicts."""

    def __init__(self, **options: Any) -> None:
        super().__init__(process_group=SELF, **options)
        self.pending: tuple[list[NamedTensor], dict[str, Any]] = ([], {})

    def capture_optimizer(self, optimizer: Any, model: Any) -> tuple[list[NamedTensor], dict[str, Any]]:
        return self.pending


def load_lightning(path: str, storage_options: dict[str, Any] | None = None, verify: bool = True) -> dict[str, Any]:
    """Lightning's checkpoint dict from one of our checkpoints written by :class:`CkptCheckpointIO` (no pickle)."""
    reader = CheckpointReader(path, storage_options, verify=verify)
    tree = reader.manifest.extra.get(EXTRA_KEY)
    if not isinstance(tree, dict):
        raise CkptError(
            f"{reader.path}: not written from Lightning (no extra.{EXTRA_KEY}); restore it with ckpt.restore"
        )
    return join(reader.read, reader.names(), tree)


class CkptCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing ckpt's format asynchronously (see the module docstring).

    ``async_save=False`` writes before ``save_checkpoint`` returns.  ``codec``/``storage_options`` are the
    :class:`ckpt.Checkpointer`'s (a path may be an fsspec URL such as ``s3://bucket/run/last.ckpt``);
    ``verify=False`` skips the checksum check of each tensor on load.  ``on_save(path, result)`` is called on
    global rank zero once a checkpoint is committed (from the writer thread).  ``local_dir`` (a node-local
    folder): the node-local tier of :mod:`.lightning_tier`: written there, copied to the path in the background,
    loaded from there on a restart on the same node."""

    def __init__(
        self,
        *,
        async_save: bool = True,
        codec: str = "raw",
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
        on_save: Callable[[str, Any], None] | None = None,
        local_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.async_save = async_save
        self.codec = codec
        self.storage_options = storage_options
        self.verify = verify
        self.on_save = on_save
        self._checkpointer: _RankZeroCheckpointer | None = None
        self._inflight: str | None = None
        self.local_dir = None if local_dir is None else os.fspath(local_dir)
        self._persister = Persister(storage_options)

    # -- saving --------------------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint got storage_options={storage_options!r}: set "
                "CkptCheckpointIO(storage_options=...) instead"
            )
        target = os.fspath(path)
        if self._checkpointer is None:
            self._checkpointer = _RankZeroCheckpointer(
                async_save=self.async_save, codec=self.codec, storage_options=self.storage_options
            )
        model, moments, tree = split(checkpoint)
        self._checkpointer.pending = (moments, optimizer_tree(moments, tree))
        if "://" not in target:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            if Path(target).is_file():  # a Lightning .ckpt file of an earlier run at this path: replaced
                Path(target).unlink()
        on_commit = None if self.on_save is None else (lambda result: self.on_save(target, result))  # type: ignore[misc]
        self._inflight = target
        where = target if self.local_dir is None else local_path(self.local_dir, target)
        if self.local_dir is not None:
            self._persister.wait()  # the previous copy: its error now, not lost
            Path(where).parent.mkdir(parents=True, exist_ok=True)
        saved = self._checkpointer.save(
            where,
            step=int(checkpoint.get("global_step", 0) or 0),
            model=model,
            optimizer=moments or None,
            options=SaveOptions(
                rng=False,  # Lightning restores no RNG; its loops reseed
                extra={EXTRA_KEY: tree},
                overwrite=True,  # Lightning overwrites last.ckpt at every save
                lazy=False,  # the host copy is taken now: Lightning's loop may edit any tensor next
                on_commit=on_commit,
            ),
        )
        if self.local_dir is not None:
            self._persister.start(saved, where, target)

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error."""
        self._inflight = None
        if self._checkpointer is not None:
            self._checkpointer.wait()
        self._persister.wait()

    # -- loading -------------------------------------------------------------------------------------------
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        target = os.fspath(path)
        if target == self._inflight:
            self.wait()
        if self.local_dir is not None and Path(local_path(self.local_dir, target), MANIFEST_NAME).is_file():
            target = local_path(self.local_dir, target)  # this node's copy of the same checkpoint: no remote read
        storage = open_storage(target, self.storage_options)
        if storage.exists(MANIFEST_NAME):
            checkpoint = load_lightning(target, self.storage_options, self.verify)
        elif "://" not in target and Path(target).is_file():
            from ckpt.converters.lightning_pickle import load_ckpt_file

            checkpoint = load_ckpt_file(Path(target))
        else:
            raise FileNotFoundError(f"{target}: no checkpoint there (neither ours, with {MANIFEST_NAME}, nor a .ckpt file)")
        if map_location is not None:
            checkpoint = _move(checkpoint, map_location)
        return checkpoint

    # -- removing ------------------------------------------------------------------------------------------
    def remove_checkpoint(self, path: Any) -> None:
        target = os.fspath(path)
        if target == self._inflight:  # ModelCheckpoint drops a checkpoint still being written: finish it first
            self.wait()
        if self.local_dir is not None:
            drop_local(local_path(self.local_dir, target))
        if "://" not in target and Path(target).is_file():
            Path(target).unlink()
            return
        storage = open_storage(target, self.storage_options)
        storage.delete(MANIFEST_NAME)  # first: a half-deleted folder is never taken for a checkpoint
        storage.delete_tree("")
        if "://" not in target and Path(target).is_dir():
            Path(target).rmdir()

    def teardown(self) -> None:
        """Wait for the last save and raise its error (Lightning calls this at the end of ``fit``, on every rank).

        In a distributed job every rank then waits for rank zero's write (a barrier), so a rank that reads a
        checkpoint right after ``fit`` (``trainer.test(ckpt_path="best")``) finds it committed.  Not when the
        teardown is Lightning's exception handling: the other ranks may be gone."""
        checkpointer, self._checkpointer = self._checkpointer, None
        failing = sys.exc_info()[0] is not None
        try:
            if checkpointer is not None:
                try:
                    checkpointer.wait()
                finally:
                    self._inflight = None
                    checkpointer.close()
            self._persister.wait()
        finally:
            if not failing and dist.is_available() and dist.is_initialized():
                dist.barrier()


def _move(value: Any, where: Any) -> Any:
    """``torch.load``'s ``map_location`` for a device or device name (the forms Lightning passes)."""
    if isinstance(value, torch.Tensor):
        return value.to(where) if isinstance(where, (str, torch.device)) else value
    if isinstance(value, dict):
        return type(value)((k, _move(v, where)) for k, v in value.items()) if type(value) is not dict else {
            k: _move(v, where) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_move(v, where) for v in value]
    return value
