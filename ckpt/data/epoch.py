"""The record an adapter hands to the sampler or split dataset it moves when an epoch is resumed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

JSON = Any


@dataclass(frozen=True)
class EpochResume:
    """A resumed epoch, as an adapter hands it to the sampler or split dataset it moves: from global index ``start``
    of ``order``'s sequence this rank continues its share, of which it already had ``skip``; ``batch`` is the
    loader's batch size (a map-style split deals whole batches to ranks)."""

    order: dict[str, JSON]
    epoch: int
    start: int
    skip: int
    batch: int = 1
