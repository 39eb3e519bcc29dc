"""ckpt: distributed checkpointing, conversion and resume verification for Trainium (Neuron) and CUDA training.

Library entry points::

    mgr = ckpt.CheckpointManager("s3://bucket/run", keep_last=3, async_save=True)
    mgr.save(step, model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    mgr.restore_latest(model=model, optimizer=opt, scheduler=sched, dataloader=loader)

    ckpt.save(path, step=..., model=...)          # one synchronous save
    ckpt.restore(path, model=..., optimizer=...)  # restore in place (any number of ranks)
    reader = ckpt.open_checkpoint(path)           # lazy per-tensor reads for tools
    ckpt.diff(a, b, atol=0)                       # two checkpoints in any formats, tensor by tensor
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import lazy

__version__ = "0.1.0"

# Public name -> the module that defines it.  Imported on first use (PEP 562), so that ``import ckpt`` and the
# commands that never touch a tensor (``ckpt --help``, ``ls``, ``inspect``, ``report``) do not pay for torch.
_EXPORTS = {
    "CheckpointInfo": "restoring.discovery",
    "list_checkpoints": "restoring.discovery",
    "AsyncSaveError": "errors",
    "BaseMismatchError": "errors",
    "CheckpointExistsError": "errors",
    "CkptError": "errors",
    "CorruptionError": "errors",
    "LayoutError": "errors",
    "ManifestError": "errors",
    "StateMismatchError": "errors",
    "StorageError": "errors",
    "UnsafePickleError": "errors",
    "diff": "converters.diff",
    "RestoreResult": "restoring.loader",
    "restore": "restoring.loader",
    "CheckpointManager": "manager",
    "FORMAT_VERSION": "format.manifest",
    "Box": "format.manifest",
    "Layout": "format.manifest",
    "Manifest": "format.manifest",
    "CheckpointReader": "format.reader",
    "open_checkpoint": "format.reader",
    "Checkpointer": "saving.checkpointer",
    "SaveOptions": "saving.options",
    "SaveResult": "saving.checkpointer",
    "StagingInfo": "saving.checkpointer",
}

if TYPE_CHECKING:
    from .converters.diff import diff
    from .errors import (
        AsyncSaveError,
        BaseMismatchError,
        CheckpointExistsError,
        CkptError,
        CorruptionError,
        LayoutError,
        ManifestError,
        StateMismatchError,
        StorageError,
        UnsafePickleError,
    )
    from .format.manifest import FORMAT_VERSION, Box, Layout, Manifest
    from .format.reader import CheckpointReader, open_checkpoint
    from .manager import CheckpointManager
    from .restoring.discovery import CheckpointInfo, list_checkpoints
    from .restoring.loader import RestoreResult, restore
    from .saving.checkpointer import Checkpointer, SaveResult, StagingInfo
    from .saving.options import SaveOptions


_SUBMODULES = ("data", "dcp", "integrations", "resume")
"""Framework adapters, imported on first use (``ckpt.dcp.Reader`` imports torch.distributed.checkpoint)."""


_exported = lazy.exports(__name__, _EXPORTS, cache=globals())


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    return _exported(name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def save(path: str, *, step: int, **state: Any) -> SaveResult:
    """Save one checkpoint synchronously to ``path`` (call on every rank). See :meth:`Checkpointer.save`.

    ``state``: the training objects (``model=``, ``optimizer=``, ...), the :class:`SaveOptions` fields as plain
    keywords (``rng=False``, ``progress={...}``, ``adapter_only=True``, ...) and ``storage_options=``."""
    from .saving.checkpointer import Checkpointer
    from .saving.options import split_keywords

    storage_options = state.pop("storage_options", None)
    objects, options = split_keywords(state, "ckpt.save")
    saver = Checkpointer(async_save=False, storage_options=storage_options)
    return saver.save(path, step=step, options=options, **objects).result()


__all__ = [
    "AsyncSaveError",
    "BaseMismatchError",
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
    "SaveOptions",
    "SaveResult",
    "StagingInfo",
    "StateMismatchError",
    "StorageError",
    "UnsafePickleError",
    "diff",
    "list_checkpoints",
    "open_checkpoint",
    "restore",
    "save",
]
