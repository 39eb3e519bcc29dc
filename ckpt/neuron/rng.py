"""XLA / neuronx-distributed RNG state: the seed slot of the manifest's per-rank RNG record.

NxD's ``XLARNGStatesTracker`` (``parallel_layers/random.py``) maps a name (``"model-parallel-rng"``) to a state
taken with ``torch.get_rng_state()``: a uint8 tensor, not an int.  Both kinds are kept as they are (ints as ints,
tensors as cloned CPU tensors, encoded by :mod:`ckpt.format.treecodec`), together with the tracker's used seeds, so that
a restore puts back exactly what ``get_states()`` returned.

Importing this module registers :data:`XLA_RNG` with :mod:`ckpt.state.rng` (the ``ckpt.neuron`` package imports it,
and ``pyproject.toml`` names it under the ``ckpt.rng_streams`` entry points for a process that uses torch_xla without
importing ``ckpt.neuron``).  torch_xla itself is imported only to restore or re-seed, never to capture.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ckpt.state import rng


def _state_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().clone()
    return int(v)


def _tracker() -> Any:
    try:
        from neuronx_distributed.parallel_layers import random as nxd_random  # type: ignore[import-not-found]
    except ImportError:
        return None
    return nxd_random.get_xla_rng_tracker()


def capture_xla() -> dict[str, Any]:
    if "torch_xla" not in sys.modules:  # importing it here would initialise a device just to save a checkpoint
        return {}
    import torch_xla.core.xla_model as xm

    out: dict[str, Any] = {"xla_seed": int(xm.get_rng_state())}
    tracker = _tracker()
    if tracker is None:
        return out
    out["xla_nxd_tracker"] = {str(k): _state_value(v) for k, v in tracker.get_states().items()}
    seeds = getattr(tracker, "seeds_", None)
    if seeds is not None:
        out["xla_nxd_tracker_seeds"] = sorted(int(s) for s in seeds)
    return out


def restore_xla(state: dict[str, Any]) -> list[str]:
    done = []
    if "xla_seed" in state:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state["xla_seed"]))
        done.append("xla")
    if "xla_nxd_tracker" in state:
        tracker = _tracker()
        if tracker is None:
            return done
        tracker.set_states({k: _state_value(v) for k, v in dict(state["xla_nxd_tracker"]).items()})
        if "xla_nxd_tracker_seeds" in state and hasattr(tracker, "seeds_"):
            tracker.seeds_ = {int(s) for s in state["xla_nxd_tracker_seeds"]}
        done.append("xla_nxd_tracker")
    return done


def reseed_xla(stream: str, seed: int) -> None:
    """Re-derive an XLA stream (ckpt.state.rng's rule across a DP change): the device seed, or every NxD tracker state."""
    if stream == "xla_seed":
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(seed))
        return
    tracker = _tracker()
    if tracker is None:
        return
    states = {}
    for i, name in enumerate(sorted(tracker.get_states())):
        states[name] = torch.Generator().manual_seed((seed + i) & ((1 << 63) - 1)).get_state()
    tracker.set_states(states)


class XlaRng:
    """The XLA seed and NxD's tracker as a :class:`ckpt.state.rng.RngStream`."""

    keys = ("xla_seed", "xla_nxd_tracker", "xla_nxd_tracker_seeds")

    def capture(self) -> dict[str, Any]:
        return capture_xla()

    def restore(self, state: dict[str, Any]) -> list[str]:
        return restore_xla(state)

    def reseed(self, key: str, seed: int) -> bool:
        if key not in ("xla_seed", "xla_nxd_tracker") or "torch_xla" not in sys.modules:
            return False
        reseed_xla(key, seed)
        return True


XLA_RNG = XlaRng()
rng.register(XLA_RNG)
