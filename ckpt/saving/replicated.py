"""Comparing replicated state across ranks before one copy is saved.

The saver writes each replicated box (DDP replicas, TP-replicated norms, PP-shared tensors) from one rank only
(:func:`ckpt.saving.planning.assign_writers`).  If the copies diverged (a desynchronised run: a real bug class), which rank
wrote would decide what the checkpoint holds, silently.  So every holder hashes its copy (xxh3-128 of the bytes) and
the small digests are all-gathered; any difference refuses the save on every rank, naming the tensor and which ranks
hold which value.  Cost: one read of every replicated byte per rank (plus a device->host copy of XLA tensors) and
one all-reduce of four integers when each piece's replica group is known (:func:`check_replica_groups`: every
holder adds a hash of (group, box, digest), the group's first member that hash times the group's size, so the two
sums differ iff some copy differs); the digests are all-gathered (:func:`check_replicas`) only when the groups are
not known or the sums differ, to name the tensor and the ranks.  Measured in bench/bench_replicas.py
(docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import xxhash

from ..distributed import Collective
from ..errors import ReplicaMismatchError
from ..format.manifest import Box
from .planning import CHECK_MOD, Group, HeldBox, _h64

#: how many disagreeing tensors one error names
_LISTED = 3


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3-128 of the tensor's bytes (moved to host memory when it lives on a device)."""
    host = t.detach()
    if host.device.type != "cpu":
        host = host.cpu()
    raw = host.contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_128_hexdigest(memoryview(raw))


def replicated_keys(per_rank: list[list[HeldBox]]) -> set[tuple[str, Box]]:
    """The ``(tensor, box)`` pairs held by more than one rank."""
    seen: dict[tuple[str, Box], int] = {}
    for pieces in per_rank:
        for p in pieces:
            seen[(p.name, p.box)] = seen.get((p.name, p.box), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def check_replicas(
    coll: Collective,
    replicated: list[list[HeldBox]] | set[tuple[str, Box]] | None,
    local: Mapping[tuple[str, Box], torch.Tensor],
) -> None:
    """Collective: raise ``ReplicaMismatchError`` on every rank when any replicated box differs between ranks.

    ``replicated``: every rank's pieces (the exact plan), or the keys this rank holds that have replicas (the
    local plan's groups); the keys compared are those any rank sent, so every rank decides the same."""
    assert replicated is not None
    keys = replicated_keys(replicated) if isinstance(replicated, list) else replicated
    mine = {k: tensor_digest(t) for k, t in local.items() if k in keys}
    gathered = coll.all_gather(mine)
    every = {k for digests in gathered for k in digests}
    bad: list[str] = []
    for key in sorted(every, key=lambda k: (k[0], k[1].offsets)):
        groups: dict[str, list[int]] = {}
        for rank, digests in enumerate(gathered):
            if key in digests:
                groups.setdefault(digests[key], []).append(rank)
        if len(groups) > 1:
            ranks = sorted(groups.values(), key=lambda rs: (-len(rs), rs))
            box = "" if all(o == 0 for o in key[1].offsets) else f" box at {list(key[1].offsets)}"
            parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {rs}" for rs in ranks)
            bad.append(f"{key[0]}{box} ({parts} hold different values)")
    if bad:
        more = f" (+{len(bad) - _LISTED} more)" if len(bad) > _LISTED else ""
        raise ReplicaMismatchError(
            f"replicated state differs between ranks, nothing saved: {', '.join(bad[:_LISTED])}{more}; the ranks "
            "are out of sync (a desynchronised data-parallel run, or state set on one rank only)"
        )


def check_replica_groups(
    coll: Collective, held: list[tuple[HeldBox, Group]], local: Mapping[tuple[str, Box], torch.Tensor]
) -> None:
    """Collective: :func:`check_replicas` for pieces whose replica groups the local plan derived (``held``: this
    rank's pieces that have replicas, with their groups), in bytes per rank independent of the world size.

    Two independent hash pairs (each sum modulo ``CHECK_MOD``, as ``ckpt.saving.planning.plan_check``): a differing copy
    goes unnoticed with probability about 2**-62.  On a difference every rank falls back to the all-gather, which
    names the tensor and the ranks (ReplicaMismatchError)."""
    a1 = b1 = a2 = b2 = 0
    for p, g in held:
        d = tensor_digest(local[(p.name, p.box)])
        h1 = _h64(("replica-1", g.key, g.size, p.name, p.box.offsets, p.box.lengths, d)) % CHECK_MOD
        h2 = _h64(("replica-2", g.key, g.size, p.name, p.box.offsets, p.box.lengths, d)) % CHECK_MOD
        a1, a2 = (a1 + h1) % CHECK_MOD, (a2 + h2) % CHECK_MOD
        if g.index == 0:
            b1, b2 = (b1 + g.size * h1) % CHECK_MOD, (b2 + g.size * h2) % CHECK_MOD
    t = coll.all_reduce_sum([a1, b1, a2, b2])
    if (t[0] - t[1]) % CHECK_MOD or (t[2] - t[3]) % CHECK_MOD:
        check_replicas(coll, {(p.name, p.box) for p, _ in held}, local)


__all__ = ["check_replica_groups", "check_replicas", "replicated_keys", "tensor_digest"]
