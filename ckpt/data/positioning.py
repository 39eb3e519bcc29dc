"""Saving and restoring a loader's data position (the orchestration behind ckpt.data.restore)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from ..errors import StateMismatchError
from ..format import treecodec
from ..format.data_position import DataPosition, RankPosition, merge
from .adapters import adapter_for, describe
from .first_iter import keep_rng_on_next_iter


def position_of(loader: Any) -> dict[str, Any] | None:
    """This rank's position as JSON (None when no adapter knows the loader)."""
    adapter = adapter_for(loader)
    if adapter is None:
        return None
    pos = adapter.position(loader)
    return pos.to_json() if pos is not None else None


def merge_json(per_rank: list[dict[str, Any] | None], progress: dict[str, Any]) -> dict[str, Any] | None:
    """Rank 0: the manifest's ``data_position`` from every rank's :func:`position_of`, in rank order."""
    merged = merge([RankPosition.from_json(p) if p is not None else None for p in per_rank], progress)
    return merged.to_json() if merged is not None else None


@dataclass(frozen=True)
class DataRestore:
    """How a restore placed the loader: ``mode`` is ``"carried"`` (this rank's own saved state loaded),
    ``"positioned"`` (continued the global position on the same DP size) or ``"re-split"`` (another DP size)."""

    mode: str
    saved_dp: int
    world: int
    samples: int | None = None
    epoch: int | None = None


def restore(
    loader: Any, manifest: Any, rank: int, world: int, where: str, strict: bool = True
) -> DataRestore:
    """Put ``loader`` at the checkpoint's data position, for rank ``rank`` of ``world``. Call on every rank."""
    pos = DataPosition.from_json(manifest.data_position, where) if manifest.data_position else None
    saved_dp = pos.dp if pos is not None else len(manifest.data) or manifest.layout.world_size
    adapter = adapter_for(loader)
    if pos is not None and adapter is not None and adapter.name == pos.adapter:
        adapter.reposition(loader, pos, rank, world, where)
        live_dp = adapter.dp(loader) if hasattr(adapter, "dp") else world
        mode = "positioned" if live_dp == saved_dp else "re-split"
        keep_rng_on_next_iter(loader)
        return DataRestore(mode, saved_dp, live_dp, pos.samples, pos.epoch)
    if world != saved_dp:
        if pos is not None and adapter is not None:
            why = f"its position was saved by the {pos.adapter!r} adapter, the live loader matches {adapter.name!r}"
        elif pos is not None:
            why = f"no data adapter matches the live loader ({describe(loader)})"
        else:
            why = f"the checkpoint has no data_position and no adapter matches the live loader ({describe(loader)})"
        msg = (
            f"{where}: data-loader state was saved by {saved_dp} ranks, restoring on {world}: {why}; "
            "ckpt re-splits torch's DistributedSampler and ckpt.data.split_dataset_by_node (map-style or IterableDataset) under a StatefulDataLoader "
            "or ckpt.data.track(DataLoader), other loaders need an adapter (ckpt.data.register, docs/guide.md 'Changing the number of ranks')"
        )
        if strict:
            raise StateMismatchError(msg)
        warnings.warn(msg + "; strict=False: loading rank-wise anyway", stacklevel=3)
    if str(rank) not in manifest.data:
        raise StateMismatchError(f"{where}: checkpoint holds no data-loader state for rank {rank}")
    from ..state.training import load_state_into

    load_state_into(loader, treecodec.decode(manifest.data[str(rank)]), "dataloader")
    keep_rng_on_next_iter(loader)
    return DataRestore("carried", saved_dp, world)
