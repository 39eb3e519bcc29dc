"""Hugging Face map-style datasets split per rank (``split_dataset_by_node``), made re-splittable.

``datasets.distributed.split_dataset_by_node(ds, rank, world)`` gives rank r the r-th contiguous block of ``ds``: a
rank cannot reach the rows of another rank's block, so ckpt cannot continue such a split on another DP size.
:func:`split_dataset_by_node` here splits the same way (same blocks, same rows) but keeps the full dataset, so a
restore can hand the new ranks the rows the saved run had left.

The global order of an epoch is *step-major*: step s of the saved run took rows ``s*b .. (s+1)*b`` of every rank's
block (b = per-rank batch), so its global list is those chunks in step, then rank, order, and the samples the job
consumed are a prefix of it.  On W' ranks of batch b' the rest of that list is cut into global batches of W'*b'
and rank r' takes the r'-th chunk of each: with an unchanged global batch every later step holds the same rows as
the uninterrupted run's.  The loader must read its rank's rows in order (no shuffling sampler).  Call
``dataset.set_epoch(e)`` at each epoch: the resumed rows apply to the resumed epoch only.
"""

from __future__ import annotations

from typing import Any

from ..errors import StateMismatchError
from .epoch import EpochResume
from .hf_iterable import SplitIterable, is_hf_iterable, split_iterable_by_node

KIND = "hf_split"


def block(n: int, rank: int, world: int) -> range:
    """Rank ``rank``'s contiguous rows, exactly as ``datasets.Dataset.shard(world, rank, contiguous=True)``."""
    div, mod = divmod(n, world)
    start = div * rank + min(rank, mod)
    return range(start, start + div + (1 if rank < mod else 0))


def global_order(order: dict[str, Any]) -> list[int | None]:
    """The step-major global list of the split described by ``order`` (dataset_len, num_replicas, batch_size).

    Blocks differ in length by one row when the rows do not divide evenly: the last step of a shorter block
    leaves a hole (None) where its row would be, so that every step keeps its place in the list.
    """
    n, world, b = int(order["dataset_len"]), int(order["num_replicas"]), int(order["batch_size"])
    blocks = [block(n, r, world) for r in range(world)]
    longest = max(len(x) for x in blocks)
    out: list[int | None] = []
    for s in range(0, longest, b):
        for x in blocks:
            chunk: list[int | None] = list(x[s : s + b])
            out.extend(chunk + [None] * (b - len(chunk)))
    while out and out[-1] is None:
        out.pop()
    return out


def rank_rows(order: dict[str, Any], start: int, rank: int, world: int, batch: int) -> list[int]:
    """Rows of rank ``rank`` of ``world`` (batch ``batch``) for the rest of the epoch from global index ``start``
    (holes dropped)."""
    rest = global_order(order)[start:]
    step = world * batch
    chunks = (rest[s + rank * batch : s + (rank + 1) * batch] for s in range(0, len(rest), step))
    return [i for c in chunks for i in c if i is not None]


class SplitDataset:
    """Rank ``rank``'s rows of ``dataset`` (map-style), keeping the full dataset for a re-split restore."""

    def __init__(self, dataset: Any, rank: int, world_size: int) -> None:
        self.dataset, self.rank, self.world_size, self.epoch = dataset, rank, world_size, 0
        self._resume: EpochResume | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def rows(self) -> list[int] | range:
        r = self._resume
        if r is not None and r.epoch == self.epoch:
            return rank_rows(r.order, r.start, self.rank, self.world_size, r.batch)[r.skip :]
        return block(len(self.dataset), self.rank, self.world_size)

    def __len__(self) -> int:
        return len(self.rows())

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.rows()[i]]

    def epoch_base(self) -> tuple[int, int]:
        r = self._resume
        return (r.start, r.skip) if r is not None and r.epoch == self.epoch else (0, 0)

    def order_spec(self, batch: int) -> dict[str, Any]:
        r = self._resume
        if r is not None and r.epoch == self.epoch:
            return dict(r.order)
        return {
            "kind": KIND,
            "dataset_len": len(self.dataset),
            "num_replicas": self.world_size,
            "batch_size": batch,
        }

    def reposition(self, resume: EpochResume) -> None:
        if resume.order.get("dataset_len") != len(self.dataset):
            raise StateMismatchError(
                f"data_position.order.dataset_len is {resume.order.get('dataset_len')}, the live dataset has "
                f"{len(self.dataset)} rows: the saved position indexes another dataset"
            )
        self._resume = resume
        self.epoch = resume.epoch


def split_dataset_by_node(dataset: Any, rank: int, world_size: int) -> SplitDataset | SplitIterable:
    """Like ``datasets.distributed.split_dataset_by_node`` (same rows per rank), but re-splittable by ckpt on
    another DP size.  A map-style dataset gets its contiguous block (:class:`SplitDataset`); a
    ``datasets.IterableDataset`` every ``world_size``-th example (the ``"examples"`` strategy,
    :func:`ckpt.data.hf_iterable.split_iterable_by_node`).  Use it under a StatefulDataLoader (or
    ``ckpt.data.track``-ed DataLoader) that reads in order, and call ``set_epoch`` at each epoch."""
    if is_hf_iterable(dataset):
        return split_iterable_by_node(dataset, rank, world_size)
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise StateMismatchError(
            f"{type(dataset).__name__} is neither a map-style dataset nor a datasets.IterableDataset: ckpt cannot "
            "split it (restore it on the saving DP size, or register an adapter: ckpt.data.register)"
        )
    return SplitDataset(dataset, rank, world_size)
