"""Per-step digests of the *global* batch that stay comparable when the DP size changes.

``ckpt.resume.ledger.digest_ids`` hashes one rank's batch in order: after a change of DP size the ranks hold other
parts of the global batch, so those digests cannot be compared.  A global digest hashes the multiset of every
rank's sample ids, order-free, as the sum modulo 2^64 of one 64-bit hash per sample, spelled ``ms:<16 hex>``.
Because it is a sum, the digests of consecutive steps add up to the digest of their union
(:func:`combine_digests`): when the global batch changes too, ``ckpt verify-resume`` compares windows of steps
that consumed the same number of samples.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

PREFIX = "ms:"
_MASK = (1 << 64) - 1


def _ids(sample_ids: Any) -> list[Any]:
    if hasattr(sample_ids, "detach"):
        sample_ids = sample_ids.detach().cpu().reshape(-1).tolist()
    elif hasattr(sample_ids, "tolist"):
        sample_ids = sample_ids.tolist()
    return list(sample_ids)


def _one(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        raw = value.to_bytes(8, "little", signed=True)
    else:
        raw = b"s" + str(value).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def sample_digest(sample_ids: Iterable[Any] | Any) -> str:
    """The order-free digest of a multiset of sample ids (ints hash as int64, anything else by ``str``)."""
    total = 0
    for v in _ids(sample_ids):
        total = (total + _one(v)) & _MASK
    return f"{PREFIX}{total:016x}"


def combine_digests(digests: Iterable[str]) -> str:
    """The digest of the union of the batches whose digests are given (they must all be ``ms:`` digests)."""
    total = 0
    for d in digests:
        if not is_global(d):
            raise ValueError(f"{d!r} is not a global sample digest ({PREFIX}<16 hex>)")
        total = (total + int(d[len(PREFIX) :], 16)) & _MASK
    return f"{PREFIX}{total:016x}"


def is_global(digest: str | None) -> bool:
    return isinstance(digest, str) and digest.startswith(PREFIX) and len(digest) == len(PREFIX) + 16


def global_digest(sample_ids: Any, group: Any = None) -> str:
    """Digest of the global batch: every rank passes its own batch's ids (collective on ``group``).

    Log it from rank 0 as the ledger's ``data_digest``; without torch.distributed it digests the local ids.
    """
    import torch.distributed as dist

    ids = _ids(sample_ids)
    if dist.is_available() and dist.is_initialized():
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, ids, group=group)
        ids = [v for p in parts for v in p]
    return sample_digest(ids)
