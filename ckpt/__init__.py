"""ckpt: distributed checkpointing, conversion and resume verification for Trainium (Neuron) and CUDA training.

Library entry points::

    mgr = ckpt.CheckpointManager("s3://bucket/run", keep_last=3, async_save=True)
    mgr.save(step, model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    mgr.restore_latest(model=model, optimizer=opt, scheduler=sched, dataloader=loader)

    ckpt.save(path, step=..., model=...)          # one synchronous save
    ckpt.restore(path, model=..., optimizer=...)  # restore in place (any number of ranks)
    reader = ckpt.open_checkpoint(path)           # lazy per-tensor reads for tools
"""

from __future__ import annotations

from typing import Any

from .discovery import CheckpointInfo, list_checkpoints
from .errors import (
    AsyncSaveError,
    CheckpointExistsError,
    CkptError,
    CorruptionError,
    LayoutError,
    ManifestError,
    StateMismatchError,
    StorageError,
    UnsafePickleError,
)
from .loader import RestoreResult, restore
from .manager import CheckpointManager
from .manifest import FORMAT_VERSION, Box, Layout, Manifest
from .reader import CheckpointReader, open_checkpoint
from .saver import Checkpointer, SaveResult

__version__ = "0.1.0"


def save(path: str, *, step: int, **state: Any) -> SaveResult:
    """Save one checkpoint synchronously to ``path`` (call on every rank). See :meth:`Checkpointer.save`."""
    saver = Checkpointer(async_save=False, storage_options=state.pop("storage_options", None))
    return saver.save(path, step=step, **state).result()


__all__ = [
    "AsyncSaveError",
    "Box",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointReader",
    "Checkpointer",
    "CkptError",
    "CorruptionError",
    "FORMAT_VERSION",
    "Layout",
    "LayoutError",
    "Manifest",
    "ManifestError",
    "RestoreResult",
    "SaveResult",
    "StateMismatchError",
    "StorageError",
    "UnsafePickleError",
    "list_checkpoints",
    "open_checkpoint",
    "restore",
    "save",
]
