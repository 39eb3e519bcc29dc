"""Capture and restore every random number generator a training step draws from.

Stored as plain numbers/tensors through :mod:`ckpt.treecodec` (never pickled NumPy objects) so that a manifest
loads with no code execution.  The XLA seed is captured only when torch_xla is already imported: importing it
here would initialise a device just to save a checkpoint.
"""

from __future__ import annotations

import hashlib
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


# ---------------------------------------------------------------------------------------------- across a DP change
#
# The rule (docs/guide.md, "Changing the number of ranks"): on the DP size the checkpoint was saved with, every
# rank gets its own streams back (carried).  On another DP size per-rank streams cannot map one to one, so each
# stream is either
#   * carried: it was identical on every saving rank (a shared stream, e.g. seeded once for data shuffling or
#     dropout masks kept in sync), so every new rank gets that one state; or
#   * re-derived: it differed per rank; rank r's stream is seeded with derive_seed(base seed, step, r, stream), so
#     the streams differ per rank, never repeat an earlier step's, and are the same whenever the same checkpoint
#     is restored on the same DP size.
# The base seed is the caller's ``rng_seed=`` at save, or else one derived from rank 0's saved record.

RULE = "carry-or-derive/1"
_META_KEYS = ("xla_nxd_tracker_seeds",)


def _stream_keys(record: dict[str, Any]) -> list[str]:
    return [k for k in record if k not in _META_KEYS]


def shared_streams(records: dict[str, Any]) -> list[str]:
    """Streams whose saved state is identical on every rank (carried to any DP size)."""
    import json

    if not records:
        return []
    recs = list(records.values())
    first = recs[0]
    return [
        k
        for k in _stream_keys(first)
        if all(
            k in r and json.dumps(r[k], sort_keys=True) == json.dumps(first[k], sort_keys=True) for r in recs
        )
    ]


def base_record(records: dict[str, Any], seed: int | None) -> dict[str, Any] | None:
    """The manifest's ``rng_base``: the rule, the base seed and where it came from, the DP size, shared streams."""
    import json

    if not records:
        return None
    if seed is None:
        first = records[min(records, key=int)]
        digest = hashlib.blake2b(json.dumps(first, sort_keys=True).encode(), digest_size=8).digest()
        base, source = int.from_bytes(digest, "little") & ((1 << 63) - 1), "checkpoint"
    else:
        base, source = int(seed), "caller"
    return {
        "rule": RULE,
        "seed": base,
        "source": source,
        "dp": len(records),
        "shared": shared_streams(records),
    }


def derive_seed(base: int, step: int, rank: int, stream: str) -> int:
    """A 63-bit seed for ``stream`` of ``rank`` after restoring ``step`` (stable across Python versions)."""
    raw = f"{base}:{step}:{rank}:{stream}".encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & ((1 << 63) - 1)


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
        from .neuron.rng import reseed_xla

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
        {k: v for k, v in first.items() if k in shared or (k in _META_KEYS and "xla_nxd_tracker" in shared)}
    )
    derived = [
        k
        for k in _stream_keys(first)
        if k not in shared and _seed_stream(k, derive_seed(int(base["seed"]), step, rank, k))
    ]
    return carried, derived
