"""The rule for RNG streams when a checkpoint is restored on another DP size (no torch: ``ckpt inspect`` uses it).

On the DP size the checkpoint was saved with, every rank gets its own streams back (carried).  On another DP size
per-rank streams cannot map one to one, so each stream is either

* carried: it was identical on every saving rank (a shared stream, e.g. seeded once for data shuffling, or dropout
  masks kept in sync), so every new rank gets that one state; or
* re-derived: it differed per rank; rank r's stream is seeded with :func:`derive_seed` (base seed, step, r,
  stream), so the streams differ per rank, never repeat an earlier step's, and are the same whenever the same
  checkpoint is restored on the same DP size.

The base seed is the caller's ``rng_seed=`` at save, or else one derived from rank 0's saved record; both are in
the manifest's ``rng_base`` (docs/format.md).  Applying the rule is :func:`ckpt.state.rng.restore_across`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

RULE = "carry-or-derive/1"
META_KEYS = ("xla_nxd_tracker_seeds",)


def stream_keys(record: dict[str, Any]) -> list[str]:
    return [k for k in record if k not in META_KEYS]


def stream_digests(record: dict[str, Any]) -> dict[str, str]:
    """A digest of each stream of one rank's record: what a saving rank sends rank 0 (a few hundred bytes instead
    of its whole record) so that rank 0 finds the shared streams without gathering every record."""
    return {
        k: hashlib.blake2b(json.dumps(record[k], sort_keys=True).encode(), digest_size=16).hexdigest()
        for k in stream_keys(record)
    }


def base_record(records: dict[str, Any], seed: int | None) -> dict[str, Any] | None:
    """The manifest's ``rng_base``: the rule, the base seed and where it came from, the DP size, shared streams."""
    if not records:
        return None
    first = records[min(records, key=int)]
    return base_record_of(first, [stream_digests(r) for r in records.values()], seed)


def base_record_of(first: dict[str, Any], digests: list[dict[str, str]], seed: int | None) -> dict[str, Any]:
    """:func:`base_record` from the lowest rank's record and every rank's :func:`stream_digests`."""
    if seed is None:
        digest = hashlib.blake2b(json.dumps(first, sort_keys=True).encode(), digest_size=8).digest()
        base, source = int.from_bytes(digest, "little") & ((1 << 63) - 1), "checkpoint"
    else:
        base, source = int(seed), "caller"
    mine = stream_digests(first)
    return {
        "rule": RULE,
        "seed": base,
        "source": source,
        "dp": len(digests),
        "shared": [k for k in stream_keys(first) if all(d.get(k) == mine[k] for d in digests)],
    }


def derive_seed(base: int, step: int, rank: int, stream: str) -> int:
    """A 63-bit seed for ``stream`` of ``rank`` after restoring ``step`` (stable across Python versions)."""
    raw = f"{base}:{step}:{rank}:{stream}".encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def plan_across(records: dict[str, Any], base: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """(carried, re-derived) stream names for a restore on another DP size, without touching any generator."""
    if not records:
        return [], []
    shared = set((base or base_record(records, None) or {}).get("shared", []))
    first = records[min(records, key=int)]
    streams = stream_keys(first)
    return [k for k in streams if k in shared], [k for k in streams if k not in shared]
