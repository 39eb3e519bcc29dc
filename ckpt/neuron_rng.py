"""XLA / neuronx-distributed RNG state: the seed slot of the manifest's per-rank RNG record."""

from __future__ import annotations

from typing import Any


def capture_xla() -> dict[str, Any]:
    import torch_xla.core.xla_model as xm

    out: dict[str, Any] = {"xla_seed": int(xm.get_rng_state())}
    try:
        from neuronx_distributed.parallel_layers import random as nxd_random  # type: ignore[import-not-found]
    except ImportError:
        return out
    tracker = nxd_random.get_xla_rng_tracker()
    out["xla_nxd_tracker"] = {k: int(v) for k, v in tracker.get_states().items()}
    return out


def restore_xla(state: dict[str, Any]) -> list[str]:
    import torch_xla.core.xla_model as xm

    done = []
    if "xla_seed" in state:
        xm.set_rng_state(int(state["xla_seed"]))
        done.append("xla")
    if "xla_nxd_tracker" in state:
        try:
            from neuronx_distributed.parallel_layers import random as nxd_random  # type: ignore[import-not-found]
        except ImportError:
            return done
        nxd_random.get_xla_rng_tracker().set_states(dict(state["xla_nxd_tracker"]))
        done.append("xla_nxd_tracker")
    return done
