"""Checkpoint collectives on their own process group.

A save's collectives run on a dedicated gloo group, often from the background writer thread, so they can never
interleave with (or deadlock against) the training job's NCCL / XLA collectives on the default group.  Creating
the group is itself collective: the first :class:`Collective` must be constructed on every rank; later ones reuse
the same group, so one-shot ``ckpt.save`` calls do not leak process groups.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .errors import CkptError

_GROUPS: dict[tuple[str, int], Any] = {}


def gloo_group(purpose: str, timeout_s: float) -> Any:
    """The gloo group for ``purpose`` ("checkpoint", "tiers") over the current default group, created once
    (collectively, on every rank) and then reused."""
    key = (purpose, id(dist.group.WORLD))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return _GROUPS[key]


#: ``process_group=SELF``: this process checkpoints alone even inside a distributed job (a framework that saves
#: from rank 0 only, as Lightning's strategies call their ``CheckpointIO``); no collective is ever entered
SELF = "self"


class Collective:
    """Rank, world size and object collectives for checkpointing; a no-op shell in a single process."""

    def __init__(self, group: Any = None, timeout_s: float = 1800.0) -> None:
        self.active = group is not SELF and dist.is_available() and dist.is_initialized()
        if not self.active:
            self.rank, self.world_size, self.group = 0, 1, None
            return
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.group = group if group is not None else gloo_group("checkpoint", timeout_s)

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Everything to rank 0 (None on other ranks)."""
        if not self.active:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def all_reduce_sum(self, values: list[int]) -> list[int]:
        """Element-wise sums of small non-negative integers over all ranks (int64: the bytes do not grow with
        the world size, unlike ``all_gather``)."""
        if not self.active:
            return list(values)
        import torch

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return [int(v) for v in t.tolist()]

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.group)


def agreed(coll: Collective, what: str, fn: Callable[[], Any]) -> list[Any]:
    """Run ``fn`` on every rank, then gather every rank's value (collective), so that no rank is left waiting in
    the next collective for one that raised: when any rank's ``fn`` raised, every rank raises
    :class:`~ckpt.errors.CkptError` naming ``what``, the first failing rank and its reason (chained to the
    original on that rank)."""
    value, error, exc = None, None, None
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - every rank must learn it; re-raised below
        error, exc = f"{type(e).__name__}: {e}", e
    gathered = coll.all_gather((value, error))
    failed = [(r, err) for r, (_, err) in enumerate(gathered) if err is not None]
    if failed:
        rank, reason = failed[0]
        more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise CkptError(f"{what}: rank {rank} failed: {reason}{more}") from exc
    return [v for v, _ in gathered]
