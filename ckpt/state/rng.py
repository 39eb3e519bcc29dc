"""Capture and restore every random number generator a training step draws from.

Stored as plain numbers/tensors through :mod:`ckpt.format.treecodec` (never pickled NumPy objects) so that a manifest
loads with no code execution.  Python's, NumPy's, torch's and CUDA's generators are handled here; a framework's own
(torch_xla's seed and NxD's tracker: :mod:`ckpt.neuron.rng`) is an :class:`RngStream` that its package registers
(:func:`register`) when imported, so this core module names no framework package.  A process that uses such a
framework without importing its ckpt package still gets its stream: the packages declared under the entry point group
:data:`PLUGINS` (name: the framework's module, value: the ckpt module that registers its stream) are imported on
capture when that framework is already imported (never importing a framework just to save), and on restore or
re-seed when a record holds keys no registered stream owns.
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Protocol

import numpy as np
import torch

from ..format import treecodec
from .rng_rule import META_KEYS, base_record, derive_seed, stream_keys

#: the entry point group of the modules that register RNG streams (``pyproject.toml``)
PLUGINS = "ckpt.rng_streams"

#: the keys of the generators this module restores itself
BUILT_IN = ("python", "numpy", "torch", "cuda")


class RngStream(Protocol):
    """A framework's generators, kept in the per-rank RNG record under ``keys``."""

    keys: tuple[str, ...]

    def capture(self) -> dict[str, Any]:
        """Their states, by key; ``{}`` when the framework is not in use in this process."""
        ...

    def restore(self, state: dict[str, Any]) -> list[str]:
        """Set them from the decoded record ``state``; returns the generators restored."""
        ...

    def reseed(self, key: str, seed: int) -> bool:
        """Seed generator ``key`` with ``seed`` (the rule across a DP change); False when it is not in use."""
        ...


_STREAMS: list[RngStream] = []


def register(stream: RngStream) -> None:
    """Add ``stream`` (one claiming the same keys is replaced: a module imported again registers again)."""
    _STREAMS[:] = [s for s in _STREAMS if s.keys != stream.keys] + [stream]


@functools.cache
def _plugins() -> tuple[EntryPoint, ...]:
    return tuple(entry_points(group=PLUGINS))


def _streams(keys: Iterable[str] | None = None) -> list[RngStream]:
    """The registered streams, after importing the plugins: those whose framework is imported (``keys`` None), or
    every one when some of ``keys`` is neither built in nor owned by a registered stream."""
    owned = {k for s in _STREAMS for k in s.keys}
    if keys is None:
        for ep in _plugins():
            if ep.name in sys.modules:
                ep.load()
    elif any(k not in owned and k not in BUILT_IN for k in keys):
        for ep in _plugins():
            ep.load()
    return list(_STREAMS)


def capture() -> dict[str, Any]:
    """This process's RNG states as an encoded tree."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    for stream in _streams():
        state.update(stream.capture())
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
    for stream in _streams(state):
        if any(k in state for k in stream.keys):
            done.extend(stream.restore(state))
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
    else:
        owner = next((s for s in _streams([stream]) if stream in s.keys), None)
        return owner is not None and owner.reseed(stream, seed)
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
