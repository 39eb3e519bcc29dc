"""Targets: every output format is an :class:`Export` of independent *units* plus a coordinator-only *commit*.

A unit is what one process writes whole and no other unit touches: a share of tensors (our manifest's data files),
an HF shard file, a group of DCP write items in one ``.distcp`` file, one NxD (tp, pp) rank's files.  The commit is
small and written last by the coordinator, after every unit is there: our ``manifest.json``, the HF index and
``config.json``, DCP's ``.metadata``, NxD's ``scheduler.pt`` / ``user_content.pt`` / ``done`` (plus the rename of a
temp folder where the storage has one).

The units are a pure function of the plan, so every worker re-plans on its own and agrees on who writes what
(:func:`balance`) without exchanging the plan; only the :class:`Staging` location and the small receipts travel.
The one-process path is the same export run as one worker, so serial and parallel outputs are the same files.
Drivers (serial, local worker processes, torchrun ranks): :mod:`.run`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ckpt.errors import CkptError

Progress = Callable[[int], None] | None


@dataclass(frozen=True)
class Staging:
    """Where an export's units go before the commit (picklable, so workers in other processes can write there).

    ``url``: the folder the units are written into (a hidden temp folder next to the destination, or the
    destination itself for our format, whose manifest is the commit); ``attempt``: a unique id of this attempt
    (in data file names, so a failed attempt's files can be found and removed).
    """

    url: str
    attempt: str


@dataclass(frozen=True)
class UnitReceipt:
    """What one worker hands the coordinator: which units it wrote and the format's data about them (picklable)."""

    worker: int
    units: tuple[int, ...]
    data: Any


class Export(Protocol):
    """A target format over a planned conversion.

    ``begin`` / ``commit`` / ``abort`` run on the coordinator only (the instance that called ``begin``); ``write``
    runs on any worker, in any process, given the :class:`Staging` ``begin`` returned, and returns a small picklable
    receipt.
    """

    #: bytes of each unit (what :func:`balance` spreads over the workers); the unit ids are the indices
    weights: list[int]

    def begin(self, dst: str) -> Staging:
        """Refuse a used ``dst``; create the staging location and return it."""
        ...

    def write(
        self, staging: Staging, units: Sequence[int], progress: Progress = None, *, worker: int = 0
    ) -> UnitReceipt:
        """Write ``units`` whole into ``staging`` as worker ``worker``; return the receipt the commit needs."""
        ...

    def commit(self, staging: Staging, dst: str, receipts: list[UnitReceipt]) -> str:
        """Check the receipts cover every unit (:func:`check_cover`), write the format's commit, publish ``dst``."""
        ...

    def abort(self, staging: Staging) -> None:
        """Remove everything the units wrote (idempotent; ``dst`` is never half-published)."""
        ...


def check_cover(receipts: Sequence[UnitReceipt], n_units: int, where: str) -> list[UnitReceipt]:
    """The receipts sorted by worker, after checking they cover every unit exactly once.

    Workers plan on their own; a worker that planned differently (other options, another source) would leave a
    hole or write a unit twice, and the commit must not publish that.
    """
    seen: dict[int, int] = {}
    for r in receipts:
        for u in r.units:
            if u in seen:
                raise CkptError(f"{where}: unit {u} written by workers {seen[u]} and {r.worker}")
            seen[u] = r.worker
    missing = sorted(set(range(n_units)) - set(seen))
    extra = sorted(set(seen) - set(range(n_units)))
    if missing or extra:
        raise CkptError(
            f"{where}: workers wrote units {sorted(seen)}, the plan has {n_units} (missing {missing})"
        )
    return sorted(receipts, key=lambda r: r.worker)


def balance(weights: Sequence[int], n: int) -> list[list[int]]:
    """Unit ids per worker, balanced by bytes: largest first onto the lightest worker (ties: lowest id/worker).

    Deterministic, so that every worker computes the same split from the same plan.
    """
    if n < 1:
        raise ValueError(f"need at least one worker, got {n}")
    loads = [0] * n
    shares: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        w = loads.index(min(loads))
        shares[w].append(i)
        loads[w] += weights[i]
    return [sorted(s) for s in shares]


__all__ = ["Export", "Progress", "Staging", "UnitReceipt", "balance", "check_cover"]
