"""Data adapters: how ckpt reads a loader's global position and continues it on any number of ranks.

One adapter per kind of loader, tried in registration order (user adapters first).  An adapter answers two
questions: at a save, where does this rank stand (:meth:`DataAdapter.position`)?  At a restore, make this
rank's loader continue the saved global position on ``world`` ranks (:meth:`DataAdapter.reposition`).
Loaders no adapter matches keep today's behaviour: their ``state_dict`` is saved per rank and restored on the
same number of ranks only; on another DP size the restore refuses and names this hook.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch.utils.data import SequentialSampler

from ..errors import StateMismatchError
from ..format.data_position import DataPosition, RankPosition
from . import hf_iterable as hi
from . import hf_split as hs
from . import sampler as ds
from .epoch import EpochResume
from .tracked import TrackedLoader


@runtime_checkable
class DataAdapter(Protocol):
    """What a user registers (``ckpt.data.register``) to make a custom loader resumable on another DP size.

    ``name`` is recorded as ``data_position.adapter``; a restore uses the adapter of that name.  ``position``
    runs on every rank at each save (cheap: no collective); ``reposition`` on every rank at a restore, with the
    merged global position, this rank and the new world size; it raises ``StateMismatchError`` when it cannot.
    An adapter may also define ``dp(loader) -> int``, the live DP size when it is not the number of processes.
    """

    name: str

    def matches(self, loader: Any) -> bool: ...

    def position(self, loader: Any) -> RankPosition | None: ...

    def reposition(self, loader: Any, position: DataPosition, rank: int, world: int, where: str) -> None: ...


def inner_of(loader: Any) -> Any:
    """The DataLoader itself: a TrackedLoader's wrapped loader, else the loader."""
    return loader.loader if isinstance(loader, TrackedLoader) else loader


def batches_taken(loader: Any) -> tuple[int, bool]:
    """(batches handed to the training loop this epoch, whether the epoch ran out)."""
    if isinstance(loader, TrackedLoader):
        return loader.batches, loader.finished
    return stateful_batches(loader.state_dict())


def sampler_of(loader: Any) -> Any:
    """The index sampler under a DataLoader / StatefulDataLoader / TrackedLoader (None when there is none)."""
    inner = inner_of(loader)
    batch_sampler = getattr(inner, "batch_sampler", None)
    if batch_sampler is not None and hasattr(batch_sampler, "sampler"):
        return batch_sampler.sampler
    return getattr(inner, "sampler", None)


def batch_size_of(loader: Any) -> int | None:
    inner = inner_of(loader)
    size = getattr(inner, "batch_size", None)
    if size is None:
        size = getattr(getattr(inner, "batch_sampler", None), "batch_size", None)
    return int(size) if isinstance(size, int) else None


def _is_stateful_dataloader(loader: Any) -> bool:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return False
    return isinstance(loader, StatefulDataLoader)


def stateful_batches(state: dict[str, Any]) -> tuple[int, bool]:
    """(batches handed to the loop in the current iteration, iteration finished) from a StatefulDataLoader state.

    Single-process state counts ``_num_yielded``; with workers the state is a snapshot plus the steps since it.
    Both count batches *yielded to the caller*, never what workers prefetched.
    """
    if "_snapshot" in state:
        snap = state["_snapshot"]
        return int(snap.get("_snapshot_step", 0)) + int(state.get("_steps_since_snapshot", 0)), bool(
            state.get("_iterator_finished", False)
        )
    return int(state.get("_num_yielded", 0)), bool(state.get("_iterator_finished", False))


class DistributedSamplerAdapter:
    """A StatefulDataLoader or ``ckpt.data.track``-ed DataLoader over torch's DistributedSampler (any dataset:
    a list, a torch Dataset, a Hugging Face ``datasets.Dataset``)."""

    name = ds.KIND

    def matches(self, loader: Any) -> bool:
        return (isinstance(loader, TrackedLoader) or _is_stateful_dataloader(loader)) and (
            ds.is_plain_distributed_sampler(sampler_of(loader))
        )

    def position(self, loader: Any) -> RankPosition | None:
        sampler = sampler_of(loader)
        batches, finished = batches_taken(loader)
        start, skip = ds.epoch_base(sampler)
        epoch_len = ds.rank_epoch_len(sampler)
        size = batch_size_of(loader)
        consumed = epoch_len if finished else min(skip + batches * (size or 1), epoch_len)
        return RankPosition(
            self.name,
            int(sampler.epoch),
            start,
            consumed,
            size,
            ds.order_spec(sampler),
            int(sampler.rank),
            int(sampler.num_replicas),
        )

    def dp(self, loader: Any) -> int:
        """The live DP size: the sampler's ``num_replicas`` (with TP/PP it is not the number of processes)."""
        return int(sampler_of(loader).num_replicas)

    def reposition(self, loader: Any, position: DataPosition, rank: int, world: int, where: str) -> None:
        sampler = sampler_of(loader)
        order = position.order or {}
        ds.check_compatible(sampler, order, where)
        start, skip = position.resume_point(
            int(sampler.rank), int(sampler.num_replicas), where, "samples", "order"
        )
        ds.reposition(sampler, EpochResume(order, position.epoch, start, skip))
        _restart_count(loader)


class _SplitAdapter:
    """What both HF split adapters share: the loader's dataset is ckpt's split of an HF dataset, which repositions
    itself from an :class:`EpochResume` (``unit`` of its ``sequence`` name what it counts, in refusals)."""

    name: str
    unit: str
    sequence: str

    def _dataset(self, loader: Any) -> Any:
        return inner_of(loader).dataset

    def dp(self, loader: Any) -> int:
        return self._dataset(loader).world_size

    def reposition(self, loader: Any, position: DataPosition, rank: int, world: int, where: str) -> None:
        ds_ = self._dataset(loader)
        order = position.order or {}
        if order.get("kind") != self.name:
            raise StateMismatchError(
                f"{where}: saved data order is {order.get('kind')!r}, expected {self.name!r}"
            )
        start, skip = position.resume_point(ds_.rank, ds_.world_size, where, self.unit, self.sequence)
        resume = EpochResume(order, position.epoch, start, skip, batch_size_of(loader) or 1)
        try:
            ds_.reposition(resume)
        except StateMismatchError as e:  # its refusals name the checkpoint
            raise StateMismatchError(f"{where}: {e}") from None
        _restart_count(loader)


class HfSplitAdapter(_SplitAdapter):
    """A StatefulDataLoader or tracked DataLoader reading a :class:`ckpt.data.hf_split.SplitDataset` in order."""

    name = hs.KIND
    unit, sequence = "samples", "order"

    def matches(self, loader: Any) -> bool:
        inner = inner_of(loader)
        return (
            (isinstance(loader, TrackedLoader) or _is_stateful_dataloader(loader))
            and isinstance(getattr(inner, "dataset", None), hs.SplitDataset)
            and type(sampler_of(loader)) is SequentialSampler
        )

    def position(self, loader: Any) -> RankPosition | None:
        ds_ = self._dataset(loader)
        batches, finished = batches_taken(loader)
        start, skip = ds_.epoch_base()
        size = batch_size_of(loader) or 1
        epoch_len = skip + len(ds_)
        consumed = epoch_len if finished else min(skip + batches * size, epoch_len)
        return RankPosition(
            self.name, ds_.epoch, start, consumed, size, ds_.order_spec(size), ds_.rank, ds_.world_size
        )


class HfIterableAdapter(_SplitAdapter):
    """A StatefulDataLoader or tracked DataLoader over a :class:`ckpt.data.hf_iterable.SplitIterable`.

    A rank that took k examples of its stride stands at global example ``start + k*W`` when every rank took k:
    the position is that index, continued on W' ranks by striding W' from it (rank r' first takes index + r').
    """

    name = hi.KIND
    unit, sequence = "examples", "stream"

    def matches(self, loader: Any) -> bool:
        inner = inner_of(loader)
        return (isinstance(loader, TrackedLoader) or _is_stateful_dataloader(loader)) and isinstance(
            getattr(inner, "dataset", None), hi.SplitIterable
        )

    def position(self, loader: Any) -> RankPosition | None:
        ds_ = self._dataset(loader)
        batches, finished = batches_taken(loader)
        start, skip = ds_.epoch_base()
        size = batch_size_of(loader) or 1
        if finished and ds_.exhausted_at is not None:
            consumed = ds_.exhausted_at  # the stream ran out: the last batch may be short
        else:
            consumed = skip + batches * size
        return RankPosition(
            self.name, ds_.epoch, start, consumed, size, ds_.order_spec(), ds_.rank, ds_.world_size
        )


def _restart_count(loader: Any) -> None:
    """A tracked loader counts batches from the restored position on."""
    if isinstance(loader, TrackedLoader):
        loader.batches, loader.finished = 0, False


_ADAPTERS: list[DataAdapter] = [DistributedSamplerAdapter(), HfSplitAdapter(), HfIterableAdapter()]


def register(adapter: DataAdapter) -> None:
    """Add a data adapter (tried before the built-in ones; one of the same ``name`` is replaced)."""
    if not isinstance(adapter, DataAdapter):
        raise TypeError(f"{adapter!r} is not a DataAdapter (name, matches, position, reposition)")
    _ADAPTERS[:] = [adapter] + [a for a in _ADAPTERS if a.name != adapter.name]


def unregister(name: str) -> None:
    _ADAPTERS[:] = [a for a in _ADAPTERS if a.name != name]


def adapter_for(loader: Any) -> DataAdapter | None:
    return next((a for a in _ADAPTERS if a.matches(loader)), None)


def describe(loader: Any) -> str:
    """What the loader is, for a refusal: its class, its sampler, and an HF split when there is one."""
    sampler = sampler_of(loader)
    inner = inner_of(loader)
    dataset = getattr(inner, "dataset", None)
    parts = [type(loader).__name__]
    if sampler is not None:
        parts.append(f"sampler {type(sampler).__name__}")
    if dataset is not None and getattr(dataset, "_distributed", None) is not None:
        parts.append(
            "a datasets.IterableDataset split with datasets.distributed.split_dataset_by_node (its position lives "
            "in its own shards; split the full dataset with ckpt.data.split_dataset_by_node instead, which re-splits)"
        )
    elif dataset is not None and type(dataset).__module__.startswith("datasets"):
        parts.append(f"a datasets.{type(dataset).__name__} (split it with ckpt.data.split_dataset_by_node)")
    elif dataset is not None:
        parts.append(f"dataset {type(dataset).__name__}")
    return ", ".join(parts)
