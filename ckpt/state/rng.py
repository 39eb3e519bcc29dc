"""Capture and restore every random number generator a training step draws from.

Stored as plain numbers/tensors through :mod:`ckpt.format.treecodec` (never pickled NumPy objects) so that a manifest
loads with no code execution.  The XLA seed is captured only when torch_xla is already imported: importing it
here would initialise a device just to save a checkpoint.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import torch

from ..format import treecodec
from .rng_rule import META_KEYS, base_record, derive_seed, stream_keys


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
        from ..neuron.rng import capture_xla

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
        from ..neuron.rng import restore_xla

        done.extend(restore_xla(state))
    return done


def _tuplify(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_tuplify(v) for v in value)
    return value


# ---------------------------------------------------------------------------------------------- across a DP change
# The rule and its pure parts live in ckpt.state.rng_rule; this applies it to the live generators.


def _seed_stream(stream: str, seed: int) -> bool:
    if stream == "python":
        random.seed(seed)
    elif stream == "numpy":
        np.random.seed(seed % (1 << 32))
    elif stream == "torch":
        torch.random.default_generator.manual_seed(seed)
    elif stream == "cuda":
        if not torch.cuda.is_available():
            return False
        torch.cuda.manual_seed_all(seed)
    elif stream in ("xla_seed", "xla_nxd_tracker"):
        if "torch_xla" not in sys.modules:
            return False
        from ..neuron.rng import reseed_xla

        reseed_xla(stream, seed)
    else:
        return False
    return True


def restore_across(
    records: dict[str, Any], base: dict[str, Any] | None, step: int, rank: int, world: int
) -> tuple[list[str], list[str]]:
    """Apply the rule for rank ``rank`` of ``world``; returns (streams carried, streams re-derived)."""
    if not records:
        return [], []
    if world == len(records) and str(rank) in records:
        return restore(records[str(rank)]), []
    base = base or base_record(records, None)
    assert base is not None
    shared = set(base.get("shared", []))
    first = records[min(records, key=int)]
    carried = restore(
        {k: v for k, v in first.items() if k in shared or (k in META_KEYS and "xla_nxd_tracker" in shared)}
    )
    derived = [
        k
        for k in stream_keys(first)
        if k not in shared and _seed_stream(k, derive_seed(int(base["seed"]), step, rank, k))
    ]
    return carried, derived
