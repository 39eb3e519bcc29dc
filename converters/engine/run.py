"""Running an :class:`~.export.Export`: in this process, in N local worker processes, or on torchrun ranks.

All three share one protocol: the coordinator ``begin``s (refusing a used destination, creating the staging
location), workers write their :func:`~.export.balance` share of the units, the coordinator ``commit``s once every
receipt is in, and on any failure ``abort``s so that nothing is published.

Workers in other processes re-open and re-plan the source themselves (``rebuild``, a picklable callable returning
the same export): planning is deterministic, so they agree on the units without the parent shipping its plan, and
:func:`~.export.check_cover` at commit catches one that planned differently.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ckpt.errors import CkptError
from ckpt.storage import refusal

from .exchange import BlockStore, ServedSource, exchange, plan_exchange, unit_pieces
from .export import Export, Progress, Staging, UnitReceipt, balance
from .meter import Clock, MeteredSource, RankStats, ReadMeter


@dataclass
class RunReport:
    """What a driver fills in: one :class:`~.meter.RankStats` per rank (torchrun: on rank 0, every rank's; the
    serial run: its own), and on which rank this process ran.  ``clock`` started when the caller began (opening
    and planning SRC count in a rank's seconds)."""

    clock: Clock = field(default_factory=Clock)
    rank: int = 0
    ranks: list[RankStats] = field(default_factory=list)
    #: bytes of tensor data shipped to this rank by the rank that read them (:mod:`.exchange`)
    received: int = 0


@contextmanager
def metered(export: Export) -> Iterator[ReadMeter]:
    """The export's conversion reads its source through a :class:`~.meter.ReadMeter` meanwhile."""
    meter = ReadMeter()
    conv = getattr(export, "conv", None)
    if conv is None:
        yield meter
        return
    source = conv.source
    conv.source = MeteredSource(source, meter)
    try:
        yield meter
    finally:
        conv.source = source


def _stats(rank: int, meter: ReadMeter, export: Export, units: Sequence[int], report: RunReport) -> RankStats:
    written = sum(export.weights[u] for u in units)
    return RankStats(rank, meter.bytes_read, written, report.clock.seconds(), report.received)


class ConversionFailed(CkptError):
    """A torchrun conversion failed on some rank and nothing was committed (the same message on every rank).
    ``own``: this rank's own write failed (else it learned another rank's failure: under torchrun only rank 0 and
    the failing ranks need to say it)."""

    def __init__(self, message: str, *, own: bool) -> None:
        super().__init__(message)
        self.own = own


def run_serial(export: Export, dst: str, progress: Progress = None, report: RunReport | None = None) -> str:
    """Write every unit in this process, then commit."""
    with _deferred_stops():  # a Ctrl-C inside begin would leave its staging folder to no one
        staging = export.begin(dst)
    units = range(len(export.weights))
    try:
        with metered(export) as meter:
            receipt = export.write(staging, units, progress, worker=0)
        out = export.commit(staging, dst, [receipt])
    except BaseException:
        export.abort(staging)
        raise
    if report is not None:
        report.ranks = [_stats(0, meter, export, units, report)]
    return out


def _worker(rebuild: Callable[[], Export], staging: Staging, units: list[int], index: int) -> UnitReceipt:
    import torch

    torch.set_num_threads(1)
    export = rebuild()
    try:
        return export.write(staging, units, None, worker=index)
    finally:
        close = getattr(export, "close", None)
        if close is not None:
            close()


#: what stops a conversion (Ctrl-C, ``kill``): the parent's business, never a worker's
_STOP = {signal.SIGINT, signal.SIGTERM}


def _leave_sigint_to_parent() -> None:
    """Worker initializer: ignore SIGINT (then take it off the blocked set :func:`submit` started us with), and
    warnings: a worker re-plans what the parent planned, and the parent has already said each of them once."""
    import warnings

    warnings.simplefilter("ignore")
    for sig in _STOP:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP)
    from .allocator import pin_malloc

    pin_malloc()  # as the CLI process that started it (converters/engine/allocator.py)


@contextmanager
def worker_pool(n: int) -> Iterator[ProcessPoolExecutor]:
    """``n`` spawned worker processes (``--workers``) that leave Ctrl-C to this process.

    A terminal's Ctrl-C goes to every process of the foreground group, and each worker would die printing its own
    KeyboardInterrupt traceback.  Workers instead ignore SIGINT (see :func:`submit`); when this process is
    interrupted, or fails, it terminates them rather than waiting for their shares, and the interruption goes on
    (the caller removes what they wrote).
    """
    import multiprocessing as mp

    _quiet_resource_tracker()
    pool = ProcessPoolExecutor(
        max_workers=n, mp_context=mp.get_context("spawn"), initializer=_leave_sigint_to_parent
    )
    try:
        yield pool
    except BaseException:
        _stop_workers(pool)
        raise
    pool.shutdown(wait=True)


def _quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (the pool's queues register their semaphores with it) with its
    stderr on /dev/null: after an interruption killed the workers it outlives this process and would print
    "leaked semaphore objects" warnings about them (it removes them all the same) under our one line."""
    import os
    import sys
    from multiprocessing import resource_tracker

    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Terminate the workers and leave without waiting on the pool: a worker killed while it held the pool's
    call queue leaves ``shutdown(wait=True)`` waiting forever (the 120 s hang of a Ctrl-C in CI)."""
    import multiprocessing as mp

    # no public handle on the workers (``_processes``: stable since 3.2); a worker still starting is only a child
    procs = {id(p): p for p in [*(pool._processes or {}).values(), *mp.active_children()]}.values()
    for proc in procs:
        proc.terminate()  # a worker past its initializer ignores it: SIGKILL below
    for proc in procs:
        proc.join(1)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    pool.shutdown(wait=False, cancel_futures=True)


def submit(pool: ProcessPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future:
    """``pool.submit`` with SIGINT and SIGTERM blocked meanwhile: a worker the call starts inherits the blocked signal, so it
    cannot be interrupted before its initializer ignores SIGINT; one that arrives meanwhile reaches this process
    when the call returns."""
    with _deferred_stops():
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP)
        try:
            return pool.submit(fn, *args)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextmanager
def _deferred_stops() -> Iterator[None]:
    """SIGINT / SIGTERM meanwhile are acted on when the block ends, not inside it.

    Blocking them (above) is not enough once the pool has threads: the kernel hands the signal to a thread that
    does not block it and Python runs the handler in the main thread anyway, so a KeyboardInterrupt could land
    between a worker's spawn and the write of its start-up data (the worker then died with a traceback).
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    handlers = {sig: signal.getsignal(sig) for sig in _STOP}
    for sig in _STOP:
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if caught:
        handler = handlers[caught[0]]
        if callable(handler):
            handler(caught[0], None)
        elif handler == signal.SIG_DFL:
            raise KeyboardInterrupt


def run_workers(
    export: Export, dst: str, workers: int, rebuild: Callable[[], Export], progress: Progress = None
) -> str:
    """``workers`` spawned processes write the units; this process commits.  On any failure it waits for the
    other workers (leaving the pool), then aborts: nothing is ever published."""
    shares = balance(export.weights, workers)
    with _deferred_stops():  # a Ctrl-C inside begin would leave its staging folder to no one
        staging = export.begin(dst)
    try:
        receipts: list[UnitReceipt] = []
        busy = [
            i for i in range(workers) if shares[i]
        ]  # more workers than units: the rest have nothing to do
        with worker_pool(max(1, len(busy))) as pool:
            futures = {submit(pool, _worker, rebuild, staging, shares[i], i): i for i in busy}
            for fut in as_completed(futures):
                receipts.append(fut.result())
                if progress is not None:
                    progress(sum(export.weights[u] for u in shares[futures[fut]]))
        return export.commit(staging, dst, receipts)
    except BaseException:
        export.abort(staging)
        raise


def run_torchrun(
    export: Export,
    dst: str,
    rank: int,
    world: int,
    progress: Progress = None,
    report: RunReport | None = None,
) -> str:
    """torchrun: rank 0 begins and broadcasts the staging location, every rank writes its share, rank 0 gathers the
    receipts and commits (or aborts), and every rank learns the outcome.

    Before writing, the ranks exchange the stored tensors more than one of them would read (:mod:`.exchange`): each
    such tensor is read by one rank and its blocks shipped over the process group.  ``progress`` is called on rank
    0 with every rank's progress (the others add theirs to the process group's store); ``report`` gets, on rank 0,
    every rank's :class:`~.meter.RankStats`.

    Ranks on several machines need the destination on storage they all reach (a shared filesystem or an object
    store).
    """
    import torch.distributed as dist

    own = False
    if not dist.is_initialized():
        with _quiet_stdout():  # gloo says "[Gloo] Rank r is connected to ..." on every rank: one report only
            dist.init_process_group("gloo")
        own = True
    staging: Staging | None = None
    try:
        begun: list[Any] = [None]
        begin_error: Exception | None = None
        if rank == 0:
            try:
                staging = export.begin(dst)
                begun[0] = ("ok", staging)
            except Exception as e:  # noqa: BLE001 - every rank must learn it, or they wait forever
                begin_error = e
                begun[0] = ("error", f"{e}")
        dist.broadcast_object_list(begun, src=0)
        if begin_error is not None:
            raise begin_error  # rank 0: the original one-line error (e.g. DST exists)
        if begun[0][0] == "error":
            raise ConversionFailed(f"conversion failed, nothing committed: rank 0: {begun[0][1]}", own=False)
        shared: Staging = begun[0][1]
        shares = balance(export.weights, world)
        share = shares[rank]
        report = report if report is not None else RunReport()
        report.rank = rank

        def write(tell: Progress) -> tuple[Any, RankStats]:
            with metered(export) as meter, refusal.reported(dst, f"rank {rank}'s share of the output"):
                receipt = _exchange_and_write(
                    export, shares, rank, report, lambda: export.write(shared, share, tell, worker=rank)
                )
            return receipt, _stats(rank, meter, export, share, report)

        def commit(results: list[tuple[Any, RankStats]]) -> None:
            export.commit(shared, dst, [r for r, _ in results])
            report.ranks = [s for _, s in results]

        with _all_progress(rank, shared.url, progress) as tell:
            failure = _write_gather_commit(rank, world, lambda: write(tell), commit)
        if rank == 0:
            if failure:
                export.abort(shared)
            staging = None
        if failure:
            raise ConversionFailed(
                f"conversion failed, nothing committed: {failure}", own=f"rank {rank}:" in failure
            )
        return dst
    finally:
        if staging is not None:  # rank 0 left early (a collective failed): nothing is published
            export.abort(staging)
        if own:
            dist.destroy_process_group()


def _write_gather_commit(
    rank: int, world: int, write: Callable[[], Any], commit_all: Callable[[list[Any]], None]
) -> str | None:
    """Every rank runs ``write``; rank 0 gathers the receipts and runs ``commit_all`` iff no rank failed.

    Returns the failure text (the same on every rank), or None when committed.  Errors are gathered, not raised
    locally, so that no rank is left waiting in a collective.
    """
    import torch.distributed as dist

    receipt, error = None, None
    try:
        receipt = write()
    except Exception as e:  # noqa: BLE001 - reported to rank 0, then raised everywhere
        error = f"rank {rank}: {e}"
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object((receipt, error), gathered if rank == 0 else None, dst=0)
    outcome: list[Any] = [None]
    if rank == 0:
        errors = [e for _, e in gathered if e]
        if not errors:
            try:
                commit_all([r for r, _ in gathered])
            except Exception as e:  # noqa: BLE001
                errors.append(f"commit: {e}")
        outcome[0] = "; ".join(errors) or None
    dist.broadcast_object_list(outcome, src=0)
    return outcome[0]


def _exchange_and_write(
    export: Export, shares: list[list[int]], rank: int, report: RunReport, write: Callable[[], Any]
) -> Any:
    """Exchange the shared stored tensors (:mod:`.exchange`), then ``write`` with them served from memory."""
    conv = getattr(export, "conv", None)
    needs = [unit_pieces(export, s) for s in shares]
    if conv is None or any(n is None for n in needs):
        return write()  # the export cannot say what its units read: each rank reads what it needs
    plan = plan_exchange(conv.source, needs)  # type: ignore[arg-type]
    store = BlockStore()
    source = conv.source
    try:
        errors = exchange(plan, source, rank, store)
        if errors:
            raise CkptError(f"cannot read {errors[0]}")
        report.received = store.received
        conv.source = ServedSource(source, store)
        return write()
    finally:
        conv.source = source
        store.close()


@contextmanager
def _quiet_stdout() -> Iterator[None]:
    """File descriptor 1 points to /dev/null meanwhile (what C++ code prints there included)."""
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


@contextmanager
def _all_progress(rank: int, key: str, progress: Progress) -> Iterator[Progress]:
    """The progress callback this rank's units report to: rank 0's own ``progress``, fed meanwhile with what the
    other ranks add to a counter in the process group's store (polled on a thread); theirs adds to that counter."""
    import threading

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    counter = f"ckpt-convert-progress/{key}"
    if rank != 0:
        yield lambda n: store.add(counter, int(n))
        return
    if progress is None:
        yield None
        return
    seen = [0]
    stop = threading.Event()

    def poll() -> None:
        total = store.add(counter, 0)
        if total > seen[0]:
            progress(total - seen[0])
            seen[0] = total

    def loop() -> None:
        while not stop.wait(0.2):
            poll()

    thread = threading.Thread(target=loop, name="ckpt-progress", daemon=True)
    thread.start()
    try:
        yield progress
    finally:
        stop.set()
        thread.join()
        poll()  # what the last ranks added before the gather that ended this block


__all__ = [
    "ConversionFailed",
    "RunReport",
    "metered",
    "run_serial",
    "run_torchrun",
    "run_workers",
    "submit",
    "worker_pool",
]
