"""Folder formats written by several processes: HF shard files, DCP per-rank data files, NxD rank files.

Each foreign format splits into *units* that one process writes whole and that no other unit touches (an HF shard
file, a group of DCP write items in one ``.distcp`` file, one NxD (tp, pp) rank's files), plus a small *commit*
(HF index + ``config.json``, DCP ``.metadata``, NxD ``scheduler.pt`` / ``user_content.pt`` / ``done``) that only
the coordinator writes, after every unit is there, followed by the rename of the temp folder.

The split is a pure function of the conversion plan (:func:`balance` over the units' byte sizes), so every worker
re-plans on its own and agrees on who writes what without exchanging the plan; only the temp folder's path and
the small receipts travel.  The serial writers (``write_hf`` / ``write_dcp`` / ``write_nxd``) are the same
exporter run as one worker, so serial and parallel output are the same files.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ckpt.errors import CkptError

Progress = Callable[[int], None] | None


@dataclass(frozen=True)
class UnitReceipt:
    """What one worker hands the coordinator: which units it wrote and the format's data about them (picklable)."""

    worker: int
    units: tuple[int, ...]
    data: Any


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


class FolderExport(Protocol):
    """A foreign-format folder as independent units plus a coordinator-only commit.

    ``begin`` / ``commit`` / ``abort`` run on the coordinator only (the instance that called ``begin``);
    ``write`` runs on any worker, in any process, given the temp folder's path, and returns a small picklable
    receipt.
    """

    #: bytes of each unit (what :func:`balance` spreads over the workers); the unit ids are the indices
    weights: list[int]

    def begin(self, dst: Path) -> Path:
        """Create the hidden temp folder next to ``dst`` (refusing a used ``dst``) and return it."""
        ...

    def write(
        self, tmp: Path, units: Sequence[int], progress: Progress = None, *, worker: int = 0
    ) -> UnitReceipt:
        """Write ``units`` whole into ``tmp`` as worker ``worker``; return the receipt the commit needs."""
        ...

    def commit(self, tmp: Path, dst: Path, receipts: list[UnitReceipt]) -> Path:
        """Check the receipts cover every unit (:func:`check_cover`), write the format's index/metadata, rename
        ``tmp`` to ``dst``."""
        ...

    def abort(self, tmp: Path) -> None:
        """Remove ``tmp`` and everything workers put in it (idempotent)."""
        ...


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


def write_serial(export: FolderExport, dst: str | Path, progress: Progress = None) -> Path:
    """Write every unit in this process, then commit (the one-process path; same files as the parallel one)."""
    dst = Path(dst)
    tmp = export.begin(dst)
    try:
        receipt = export.write(tmp, range(len(export.weights)), progress, worker=0)
        return export.commit(tmp, dst, [receipt])
    except BaseException:
        export.abort(tmp)
        raise


def _leave_sigint_to_parent() -> None:
    """Worker initializer: ignore SIGINT (then take it off the blocked set :func:`submit` started us with)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextmanager
def worker_pool(n: int) -> Iterator[ProcessPoolExecutor]:
    """``n`` spawned worker processes (``--workers``) that leave Ctrl-C to this process.

    A terminal's Ctrl-C goes to every process of the foreground group, and each worker would die printing its own
    KeyboardInterrupt traceback.  Workers instead ignore SIGINT (see :func:`submit`); when this process is
    interrupted, or fails, it terminates them rather than waiting for their shares, and the interruption goes on
    (the caller removes what they wrote).
    """
    import multiprocessing as mp

    pool = ProcessPoolExecutor(
        max_workers=n, mp_context=mp.get_context("spawn"), initializer=_leave_sigint_to_parent
    )
    try:
        yield pool
    except BaseException:
        for proc in list(pool._processes.values()):  # no public handle on the workers; stable since 3.2
            proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def submit(pool: ProcessPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future:
    """``pool.submit`` with SIGINT blocked meanwhile: a worker the call starts inherits the blocked signal, so it
    cannot be interrupted before its initializer ignores SIGINT; one that arrives meanwhile reaches this process
    when the call returns."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return pool.submit(fn, *args)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


__all__ = [
    "FolderExport",
    "Progress",
    "UnitReceipt",
    "balance",
    "check_cover",
    "submit",
    "worker_pool",
    "write_serial",
]
