"""Reading Lightning's pickles (``.ckpt`` files, the FSDP folder's ``meta.pt``) through the safe unpickler: the
allow-list of the globals Lightning's checkpoint dict may hold besides tensors and plain containers."""

from __future__ import annotations

import argparse
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ckpt.errors import CkptError
from ckpt.safe_unpickle import load_torch_file


def allowed_globals() -> dict[tuple[str, str], Any]:
    """The globals a Lightning checkpoint may pickle besides tensors and plain containers."""
    out: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): OrderedDict,
        ("argparse", "Namespace"): argparse.Namespace,
    }
    from ckpt.integrations.lightning_state import ATTRIBUTE_DICTS

    for path in ATTRIBUTE_DICTS:
        module, _, cls = path.rpartition(".")
        try:
            import importlib

            out[(module, cls)] = getattr(importlib.import_module(module), cls)
        except ImportError:  # Lightning not installed: its AttributeDict read as a dict, same keys and values
            out[(module, cls)] = _AttributeDict
    from .hf_trainer import _NUMPY_ALLOWED

    out.update(_NUMPY_ALLOWED)
    return out


class _AttributeDict(dict):
    """What a Lightning ``AttributeDict`` is read as where Lightning is not installed (a dict with the same items)."""


def load_ckpt_file(path: Path) -> dict[str, Any]:
    """Lightning's checkpoint dict from a ``.ckpt`` file, through the safe unpickler (one-line refusals)."""
    checkpoint = load_torch_file(path, allowed_globals(), mmap=True)
    if not isinstance(checkpoint, dict) or "pytorch-lightning_version" not in checkpoint:
        raise CkptError(f"{path}: not a Lightning checkpoint (no pytorch-lightning_version key)")
    return checkpoint


__all__ = ["allowed_globals", "load_ckpt_file"]
