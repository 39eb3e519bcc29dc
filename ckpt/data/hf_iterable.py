"""Hugging Face ``datasets.IterableDataset`` split per rank, made re-splittable on another DP size.

``datasets.distributed.split_dataset_by_node(ds, rank, world)`` on an IterableDataset either hands each rank whole
shards (when ``ds.num_shards % world == 0``) or, in its ``"examples"`` strategy, makes every rank read the whole
stream and keep the examples whose index is ``rank`` modulo ``world``.  Either way the position lives inside the
rank's own iterator (shard index, example index in the shard, and a shuffle buffer whose content is not saved), so
no other DP size can continue it.

:func:`split_iterable_by_node` here always splits the ``"examples"`` way (rank r of W yields the stream's examples
r, r+W, r+2W, ...: the rows of ``split_dataset_by_node(ds, r, W, strategy="examples")``) and keeps the full
dataset.  With every rank taking b examples per step, step s of the job consumed exactly the stream's examples
``s*b*W .. (s+1)*b*W``: the job's position is one *global next-example index* into the epoch's stream.  A restore
on W' ranks starts rank r' at that index plus r' and strides by W', so with an unchanged global batch every later
step holds the uninterrupted run's examples.

The stream of an epoch is a deterministic function of the data, the dataset's shuffle generators (a buffer
shuffle included) and the epoch, so ckpt *replays* it from its start instead of restoring a shuffle buffer: exact
whenever the shuffle is seeded.  The saved order records a fingerprint of the shards and generators; a live dataset
whose fingerprint differs (another ``seed``, ``seed=None``, other shards) is refused.  The cost is that each rank
reads the stream from the start of the epoch up to the resumed index (the ``"examples"`` strategy reads every
example on every rank anyway).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from itertools import islice
from typing import Any

import torch.utils.data

from ..errors import StateMismatchError
from .epoch import EpochResume

KIND = "hf_iterable"


def is_hf_iterable(dataset: Any) -> bool:
    try:
        from datasets import IterableDataset
    except ImportError:
        return False
    return isinstance(dataset, IterableDataset)


def _generators(ex_iterable: Any, seen: set[int] | None = None) -> list[tuple[str, Any]]:
    """(examples-iterable class, generator state) for every RNG in the dataset's chain of examples iterables."""
    seen = set() if seen is None else seen
    if ex_iterable is None or id(ex_iterable) in seen:
        return []
    seen.add(id(ex_iterable))
    out: list[tuple[str, Any]] = []
    gen = getattr(ex_iterable, "generator", None)
    if gen is not None and hasattr(gen, "bit_generator"):
        out.append((type(ex_iterable).__name__, gen.bit_generator.state))
    for inner in [
        getattr(ex_iterable, "ex_iterable", None),
        *(getattr(ex_iterable, "ex_iterables", None) or []),
    ]:
        out.extend(_generators(inner, seen))
    return out


def fingerprint(dataset: Any) -> str:
    """What fixes an epoch's stream besides the data itself: shard count and every shuffle generator's state."""

    def plain(v: Any) -> Any:  # PCG64 states hold ints beyond JSON's safe range: keep them exact as text
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    doc = {
        "num_shards": int(dataset._ex_iterable.num_shards),
        "generators": [[name, plain(state)] for name, state in _generators(dataset._ex_iterable)],
    }
    return "sha256:" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class SplitIterable(torch.utils.data.IterableDataset):
    """Rank ``rank`` of ``world_size``'s examples of a Hugging Face IterableDataset (every ``world_size``-th from
    ``rank``), keeping the full dataset for a re-split restore.  Iterate it in the main process (num_workers=0)."""

    def __init__(self, dataset: Any, rank: int, world_size: int) -> None:
        super().__init__()
        self.dataset, self.rank, self.world_size, self.epoch = dataset, rank, world_size, 0
        self.exhausted_at: int | None = None  # examples the last complete iteration yielded
        self._resume: EpochResume | None = None

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; each iteration sets it on the full dataset too (it reorders shards and shifts shuffle
        seeds per epoch, so the split and datasets' own split see the same stream)."""
        self.epoch = epoch

    def _current(self) -> EpochResume | None:
        r = self._resume
        return r if r is not None and r.epoch == self.epoch else None

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        if info is not None:
            raise StateMismatchError(
                "ckpt.data.split_dataset_by_node (IterableDataset): read it in the main process (num_workers=0), "
                f"not in DataLoader workers ({info.num_workers}): workers would each yield the rank's whole stream, "
                "and the count of a short last batch would stay in the worker"
            )
        self.exhausted_at = None
        self.dataset.set_epoch(self.epoch)
        r = self._current()
        start, skip = (r.start, r.skip) if r is not None else (0, 0)
        first = start + self.rank + skip * self.world_size
        count = 0
        for example in islice(iter(self.dataset), first, None, self.world_size):
            count += 1
            yield example
        self.exhausted_at = skip + count

    def epoch_base(self) -> tuple[int, int]:
        r = self._current()
        return (r.start, r.skip) if r is not None else (0, 0)

    def order_spec(self) -> dict[str, Any]:
        r = self._current()
        if r is not None:
            return dict(r.order)
        return {"kind": KIND, "num_replicas": self.world_size, "stream": fingerprint(self.dataset)}

    def reposition(self, resume: EpochResume) -> None:
        saved, live = resume.order.get("stream"), fingerprint(self.dataset)
        if saved != live:
            raise StateMismatchError(
                f"data_position.order.stream is {saved!r}, the live IterableDataset's is {live!r}: another shard "
                "count or shuffle generator, so the saved position indexes another stream (shuffle with the same "
                "fixed seed: ds.shuffle(seed=..., buffer_size=...); seed=None draws a new order in every process)"
            )
        self._resume = resume
        self.epoch = resume.epoch


def split_iterable_by_node(dataset: Any, rank: int, world_size: int) -> SplitIterable:
    """Like ``datasets.distributed.split_dataset_by_node(dataset, rank, world_size, strategy="examples")`` (the same
    examples per rank) but re-splittable by ckpt on another DP size.  Pass the *full* IterableDataset (shuffled
    with a fixed seed, if at all), read it under a StatefulDataLoader or ``ckpt.data.track``-ed DataLoader with
    num_workers 0, and call ``set_epoch`` on the returned object at each epoch."""
    if not is_hf_iterable(dataset):
        raise StateMismatchError(
            f"{type(dataset).__name__} is not a datasets.IterableDataset (map-style datasets: "
            "ckpt.data.split_dataset_by_node)"
        )
    if getattr(dataset, "_distributed", None) is not None:
        raise StateMismatchError(
            "the IterableDataset is already split by datasets.distributed.split_dataset_by_node: pass the full "
            "dataset to ckpt.data.split_dataset_by_node, which splits it and can re-split it"
        )
    if not 0 <= rank < world_size:
        raise StateMismatchError(f"rank {rank} is not in 0..{world_size - 1} (world_size {world_size})")
    return SplitIterable(dataset, rank, world_size)
