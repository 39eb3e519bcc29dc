"""``torch.utils.data.DistributedSampler``: its global order, and continuing that order on any number of ranks.

A DistributedSampler on W ranks lays out one global list per epoch (``randperm(N)`` seeded with ``seed + epoch``,
or ``range(N)``; padded by repeating its head, or truncated with ``drop_last``, to a multiple of W) and rank r takes
every W-th item from r.  When every rank consumed k samples, the job consumed exactly the first k*W items of that
list: the global position.  Continuing it on W' ranks (:func:`rank_share`) deals the rest of the list out the same
way (rank r' takes every W'-th item from r'), so with an unchanged global batch every later global batch holds the
same samples as the uninterrupted run's; with another global batch the next sample index is still exact and no
sample of the epoch is repeated or skipped (beyond the padding DistributedSampler itself adds).  The next epoch is
the new sampler's own order.

The resumed share is dealt once: a second iteration of the same epoch number is the next epoch of a loop that never
calls ``set_epoch`` (DistributedSampler then repeats its epoch's full order, and so does the resumed sampler), not
the rest of the resumed epoch again.

The live sampler is switched to :class:`ResumedDistributedSampler` (a subclass, so ``isinstance`` and every
attribute still hold; only ``__iter__``/``__len__`` differ, and only for the resumed epoch): a DataLoader forbids
replacing its sampler, and a sampler's ``__iter__`` is looked up on its class.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from ..errors import StateMismatchError
from .epoch import EpochResume

KIND = "distributed_sampler"


def is_plain_distributed_sampler(sampler: Any) -> bool:
    """Exactly torch's DistributedSampler (or ckpt's resumed form): a subclass may order samples differently."""
    return type(sampler) in (DistributedSampler, ResumedDistributedSampler)


def order_spec(sampler: DistributedSampler) -> dict[str, Any]:
    """What recomputes the sampler's global list of an epoch (the manifest's ``data_position.order``)."""
    resume = _resume_of(sampler)
    if resume is not None:
        return dict(resume.order)
    return {
        "kind": KIND,
        "dataset_len": len(sampler.dataset),  # type: ignore[arg-type]
        "seed": int(sampler.seed),
        "shuffle": bool(sampler.shuffle),
        "drop_last": bool(sampler.drop_last),
        "num_replicas": int(sampler.num_replicas),
    }


def global_order(order: dict[str, Any], epoch: int) -> list[int]:
    """The epoch's global list exactly as DistributedSampler builds it for ``order['num_replicas']`` ranks."""
    n, world = int(order["dataset_len"]), int(order["num_replicas"])
    if order["shuffle"]:
        g = torch.Generator()
        g.manual_seed(int(order["seed"]) + epoch)
        indices = torch.randperm(n, generator=g).tolist()
    else:
        indices = list(range(n))
    if order["drop_last"] and n % world:
        total = math.ceil((n - world) / world) * world
        return indices[:total]
    total = math.ceil(n / world) * world
    return _pad(indices, total - len(indices))


def _pad(items: list[int], count: int) -> list[int]:
    if count <= 0 or not items:
        return items
    return items + (items * math.ceil(count / len(items)))[:count]


def rank_share(
    order: dict[str, Any], epoch: int, start: int, rank: int, world: int, drop_last: bool
) -> list[int]:
    """Rank ``rank`` of ``world``'s samples for the rest of the epoch from global index ``start``."""
    rest = global_order(order, epoch)[start:]
    if drop_last:
        rest = rest[: len(rest) // world * world]
    else:
        rest = _pad(rest, -len(rest) % world)
    return rest[rank::world]


class ResumedDistributedSampler(DistributedSampler):
    """A DistributedSampler that continues a saved global position during the resumed epoch, then is itself."""

    _ckpt_resume: EpochResume | None
    #: the resumed epoch's iteration has begun (its share is dealt once)
    _ckpt_dealt: bool = False

    def __iter__(self) -> Any:
        share = self._resumed_share()
        if share is not None and self._ckpt_dealt:
            # the same epoch number iterated again: a loop without set_epoch has begun its next epoch, which a
            # DistributedSampler draws as the full order of that number; the resume is over
            self._ckpt_resume = None
            share = None
        if share is None:
            return super().__iter__()
        self._ckpt_dealt = True
        return iter(share)

    def __len__(self) -> int:
        share = self._resumed_share()
        return len(share) if share is not None else super().__len__()

    def _resumed_share(self) -> list[int] | None:
        r = getattr(self, "_ckpt_resume", None)
        if r is None or r.epoch != self.epoch:
            return None
        return rank_share(r.order, r.epoch, r.start, self.rank, self.num_replicas, self.drop_last)[r.skip :]


def _resume_of(sampler: Any) -> EpochResume | None:
    r = getattr(sampler, "_ckpt_resume", None)
    return r if r is not None and r.epoch == sampler.epoch else None


def epoch_base(sampler: Any) -> tuple[int, int]:
    """``(start, skip)`` of the sampler's current iteration: (0, 0) unless it is a resumed epoch."""
    r = _resume_of(sampler)
    return (r.start, r.skip) if r is not None else (0, 0)


def rank_epoch_len(sampler: Any) -> int:
    """How many samples this rank's iteration of the current epoch yields in all (resumed part included)."""
    r = _resume_of(sampler)
    return len(sampler) + (r.skip if r is not None else 0)


def check_compatible(sampler: Any, order: dict[str, Any], where: str) -> None:
    """Refuse a live sampler that would not continue the saved order (other data, seed, or rank layout)."""
    if not is_plain_distributed_sampler(sampler):
        raise StateMismatchError(
            f"{where}: the loader's sampler is a {type(sampler).__name__}, not torch's DistributedSampler: ckpt "
            "cannot recompute its order (register an adapter: ckpt.data.register, docs/guide.md)"
        )
    if order.get("kind") != KIND:
        raise StateMismatchError(f"{where}: saved data order is {order.get('kind')!r}, expected {KIND!r}")
    live = {"dataset_len": len(sampler.dataset), "seed": int(sampler.seed), "shuffle": bool(sampler.shuffle)}
    for key, value in live.items():
        if order.get(key) != value:
            raise StateMismatchError(
                f"{where}: data_position.order.{key} is {order.get(key)!r}, the live DistributedSampler has "
                f"{value!r}: the saved position indexes another order (same dataset, seed and shuffle needed)"
            )


def reposition(sampler: DistributedSampler, resume: EpochResume) -> None:
    """Make ``sampler`` continue ``resume`` (in place) and set its epoch to the resumed one."""
    sampler.__class__ = ResumedDistributedSampler
    sampler._ckpt_resume = resume  # type: ignore[attr-defined]
    sampler._ckpt_dealt = False  # type: ignore[attr-defined]
    sampler.set_epoch(resume.epoch)
