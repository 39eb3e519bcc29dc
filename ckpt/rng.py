"""Capture and restore every random number generator a training step draws from.

Stored as plain numbers/tensors through :mod:`ckpt.treecodec` (never pickled NumPy objects) so that a manifest
loads with no code execution.  The XLA seed is captured only when torch_xla is already imported: importing it
here would initialise a device just to save a checkpoint.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import torch

from . import treecodec


def capture() -> dict[str, Any]:
    """This process's RNG states as an encoded tree."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "torch_xla" in sys.modules:
        from .neuron.rng import capture_xla

        state.update(capture_xla())
    return treecodec.encode(state, "rng")


def restore(encoded: dict[str, Any]) -> list[str]:
    """Set the RNG states from :func:`capture`'s output; returns the generators restored."""
    state = treecodec.decode(encoded)
    done = []
    if "python" in state:
        random.setstate(_tuplify(state["python"]))
        done.append("python")
    if "numpy" in state:
        np.random.set_state(state["numpy"])
        done.append("numpy")
    if "torch" in state:
        torch.set_rng_state(state["torch"])
        done.append("torch")
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) != torch.cuda.device_count():
            import warnings

            warnings.warn(
                f"checkpoint holds CUDA RNG states for {len(cuda_states)} devices, this process sees "
                f"{torch.cuda.device_count()}; restoring the common ones",
                stacklevel=2,
            )
        for i, s in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
        done.append("cuda")
    if any(k.startswith("xla") for k in state):
        from .neuron.rng import restore_xla

        done.extend(restore_xla(state))
    return done


def _tuplify(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_tuplify(v) for v in value)
    return value
