"""The tiers of one :class:`~ckpt.manager.CheckpointManager`: local saves with replicas, their persistent copies,
and restores from the newest step complete anywhere (package docstring)."""

from __future__ import annotations

import os
import threading
import time
import uuid
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from ..distributed import Collective, agreed, gloo_group
from ..errors import CkptError, StorageError
from ..format.manifest import MANIFEST_NAME
from ..restoring.discovery import step_dir
from ..saving.checkpointer import SaveResult
from ..saving.worker import Job, Worker
from ..storage import refusal
from . import agree, memory, replicate, runid
from .node import NodeMap
from .policy import LOCAL, PEER, PERSISTENT, TierPolicy
from .retention import PENDING, sweep

# the worst tier any rank restored from names the job's restore (the ledger's record)
_RANK = {LOCAL: 0, PEER: 1, PERSISTENT: 2}


def _tier_group(purpose: str = "tiers", timeout_s: float = 1800.0) -> Any:
    """A gloo group of its own for the tiers' collectives and transfers, next to the checkpoint group (created
    collectively by the first manager with tiers, then reused; None in one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return gloo_group(purpose, timeout_s)


class Host(Protocol):
    """What the tiers use of their :class:`~ckpt.manager.CheckpointManager` (which imports this module)."""

    checkpointer: Any
    storage: Any
    root: str
    layout_hook: Any

    def save_persistent(self, step: int, objects: dict[str, Any], options: Any) -> Future: ...
    def apply_retention(self, newest: int) -> list[int]: ...
    def note_save(self, result: SaveResult) -> None: ...
    def list(self, check_files: bool = False) -> list[Any]: ...
    def path_for(self, step: int) -> str: ...
    def restore_agreed(
        self,
        path: str,
        step: int,
        state: dict[str, Any],
        t0: float,
        tier: str = ...,
        job_tier: str = ...,
        verify: bool = ...,
    ) -> Any: ...


class Tiers:
    """Local tier under ``local_dir`` (one folder per node), ``replicas`` copies on peer nodes, the manager's root
    behind it.  Construct on every rank (collective: it creates its process group and learns every rank's node)."""

    def __init__(
        self,
        mgr: Host,
        local_dir: str,
        policy: TierPolicy,
        replicas: int = 0,
        keep_local: int | None = 2,
        node_rank: int | None = None,
        local_memory: bool = False,
    ) -> None:
        if local_memory and (keep_local is None or keep_local > memory.SLOTS):
            raise CkptError(
                f"local_memory=True with keep_local={keep_local!r}: the memory tier holds at most "
                f"{memory.SLOTS} snapshots per rank (keep_local=1 or 2)"
            )
        if local_memory and not mgr.checkpointer.async_save:
            raise CkptError(
                "local_memory=True needs async_save=True (the memory tier is the async save's arena)"
            )
        if keep_local is not None and (isinstance(keep_local, bool) or keep_local < 1):
            raise CkptError(
                f"keep_local={keep_local!r}: expected at least 1 (or None to keep every local step)"
            )
        if "://" in str(local_dir) and not str(local_dir).startswith("file://"):
            raise CkptError(f"local_dir={local_dir!r}: expected a node-local folder (a path), not a URL")
        self.mgr = mgr
        self.local_dir = Path(str(local_dir).removeprefix("file://"))
        if local_memory:
            memory.check_memory_dir(self.local_dir)
        self.policy = policy
        self.replicas = replicas
        self.keep_local = keep_local
        self.coll = Collective(_tier_group())
        self.nodes = NodeMap.build(self.coll, node_rank)
        self.nodes.check_replicas(replicas)
        self.leader = self.nodes.rank == self.nodes.leader(self.nodes.node)
        #: this run's id (module runid); None until the first save of a run the root records none of
        self.run_id: str | None = None
        self._in_root = False  # the root's run.json holds run_id
        self._ensured = False  # this node's run folder exists with its run.json
        self._resolve_run()
        self.newest_persistent: int | None = None
        self._fut: Future | None = None
        self._thread: Job | None = None
        self._worker = Worker("ckpt-tiers")  # one thread across saves (ckpt.saving.worker)
        #: the memory tier's stager (module memory), None for a local tier on disk
        self.stager: memory.MemoryStager | None = None
        self._persisting: threading.Thread | None = None  # a memory step's copy to the root, at its own pace
        self._persist_error: BaseException | None = None
        self._persist_step: int | None = None
        if local_memory:
            per_node = len(self.nodes.nodes[self.nodes.node]) * (1 + replicas)
            self.stager = memory.MemoryStager(self.coll.rank, per_node)
            mgr.checkpointer.stager.release()
            mgr.checkpointer.stager = self.stager
            # the persistent copies run beside later saves: their collectives need a group of their own
            self.pcoll = Collective(_tier_group("tiers-persist"))

    @property
    def root(self) -> Path:
        """This run's folder of the local tier (``<local_dir>/run-<id>``)."""
        assert self.run_id is not None
        return runid.folder(self.local_dir, self.run_id)

    # ------------------------------------------------------------------------------------------------ run identity
    def _resolve_run(self) -> None:
        """The run id: the root's ``run.json``; when the root cannot be read, the one run folder of the nodes that
        names this root (module :mod:`.runid`).  Collective."""
        root = self.mgr.root

        def look() -> tuple[Any, list[str]]:
            found = None
            if self.coll.rank == 0:
                try:
                    found = ("root", runid.read_root(self.mgr.storage))
                except (StorageError, OSError) as e:
                    found = ("unreachable", f"{type(e).__name__}: {e}")
            return found, runid.runs_naming(self.local_dir, root) if self.leader else []

        parts = agreed(self.coll, f"reading the run id of {root}", look)
        (kind, value), named = parts[0][0], sorted({i for _, ids in parts for i in ids})
        if kind == "root":
            self.run_id, self._in_root = value, value is not None
        elif len(named) == 1:
            self.run_id = named[0]
            self._warn(
                f"cannot read {root}/{runid.RUN_FILE} ({value}): this run's id {named[0]} is taken from "
                f"{runid.folder(self.local_dir, named[0])}/{runid.RUN_FILE}, which names this root"
            )
        elif named:
            self._warn(
                f"cannot read {root}/{runid.RUN_FILE} ({value}) and several run folders name this root "
                f"({', '.join(runid.PREFIX + n for n in named)}): none is taken for this run's"
            )
        self.mgr.checkpointer.run_id = self.run_id

    def _establish(self, tiers: tuple[str, ...]) -> None:
        """Before a save: a run without an id gets one, recorded create-only in the root (once; retried at saves
        to the persistent tier while the root could not be written), and this node's run folder.  Collective."""
        if self.run_id is not None and self._ensured and (self._in_root or PERSISTENT not in tiers):
            return
        root = self.mgr.root

        def record() -> tuple[str, bool, str | None] | None:
            if self.coll.rank != 0:
                return None
            if self.run_id is not None and (self._in_root or PERSISTENT not in tiers):
                return self.run_id, self._in_root, None
            rid = self.run_id or runid.new_id()
            try:
                held = runid.record_in_root(self.mgr.storage, rid, root)
            except (StorageError, OSError) as e:
                if PERSISTENT in tiers:
                    raise
                return (
                    rid,
                    False,
                    (
                        f"cannot record this run's id in {root}/{runid.RUN_FILE} ({type(e).__name__}: {e}): "
                        f"recorded in {runid.folder(self.local_dir, rid)}/{runid.RUN_FILE} only, and in the root "
                        "at the next save to it"
                    ),
                )
            if self.run_id is not None and held != self.run_id:
                raise CkptError(
                    f"{root}/{runid.RUN_FILE} records run {held}, but this run recorded {self.run_id} while the "
                    "root could not be read: two runs write one root; give each run its own root"
                )
            return held, True, None

        (got, *_) = agreed(self.coll, f"recording the run id in {root}", record)
        self.run_id, self._in_root, warning = got
        self.mgr.checkpointer.run_id = self.run_id
        if warning:
            self._warn(warning)
        rid = self.run_id
        agreed(
            self.coll,
            f"creating this run's folder in {self.local_dir}",
            lambda: runid.ensure_local(self.local_dir, rid, root) if self.leader else None,
        )
        self._ensured = True

    def _warn(self, message: str) -> None:
        if self.coll.rank == 0:
            warnings.warn(message, stacklevel=4)

    # ------------------------------------------------------------------------------------------------ saving
    def save(self, step: int, objects: dict[str, Any], options: Any) -> Future:
        """Save ``step`` (the training ``objects``, a :class:`~ckpt.SaveOptions`) to the tiers the policy names (a
        resolved future of None when none)."""
        tiers = self.policy.tiers(step)
        if not tiers:
            fut: Future = Future()
            fut.set_result(None)
            return fut
        self._wait_local()
        self._establish(tiers)
        if LOCAL not in tiers:
            self.wait()
            return self.mgr.save_persistent(step, objects, options)
        if self.stager is not None and self.stager.folder is None:
            self.stager.folder = self.root / memory.ARENA
            self.stager.drop_stale()
        token = self.coll.broadcast(uuid.uuid4().hex[:8])
        pending = self.root / PENDING / f"{step_dir(step)}-{token}"
        started = time.perf_counter()
        written = self.mgr.checkpointer.save(str(pending), step=step, options=options, **objects)
        fut = Future()
        if not self.mgr.checkpointer.async_save:
            self._finish(step, tiers, pending, started, written, fut)
            if fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
            return fut
        self._fut = fut
        self._thread = self._worker.submit(self._finish, step, tiers, pending, started, written, fut)
        return fut

    def _finish(
        self, step: int, tiers: tuple[str, ...], pending: Path, started: float, written: Future, fut: Future
    ) -> None:
        try:
            fut.set_result(self._replicate(step, tiers, pending, started, written))
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(e)

    def _replicate(
        self, step: int, tiers: tuple[str, ...], pending: Path, started: float, saved: Future
    ) -> SaveResult:
        # the checkpointer's commit into the pending folders (an async save's error is raised here, once)
        written = self.mgr.checkpointer.wait() or saved.result()
        raw, m = replicate.share_manifest(self.coll, self.nodes, pending)
        problems: list[str] = []
        try:
            problems = replicate.send_replicas(self.coll, self.nodes, self.replicas, pending, m)
        except (CkptError, OSError) as e:
            problems = [f"rank {self.coll.rank}: {refusal.reason(e, str(self.root)) or e}"]
        final = self.root / step_dir(step)
        # a step folder without a manifest (an arena reuse invalidated it, a crash) is no run's step: replaced
        if self.leader and (final / MANIFEST_NAME).exists() and runid.step_run_id(final) != self.run_id:
            problems.append(f"{final} holds a step of another run (never replaced by this run)")
        problems = [p for ps in self.coll.all_gather(problems) for p in ps]
        if not problems:
            replicate.commit(self.nodes, pending, final)
        self.coll.barrier()
        folder = pending if problems else final
        path = str(final)
        if PERSISTENT in tiers and self.stager is not None and not problems:
            self._persist_later(step, final, raw, m)
        elif PERSISTENT in tiers:
            path = replicate.persist(self.coll, self.mgr.storage, step, folder, raw, m)
            self.newest_persistent = step
            if self.coll.rank == 0:
                try:
                    self.mgr.apply_retention(step)
                except Exception as e:  # noqa: BLE001 - the step is committed; housekeeping must not undo that
                    warnings.warn(f"after committing step {step}: {type(e).__name__}: {e}", stacklevel=1)
        if problems:
            raise CkptError(
                f"local save of step {step} not committed: {'; '.join(problems[:3])}"
                + (" (its persistent copy is committed)" if PERSISTENT in tiers else "")
            )
        if self.nodes.rank == self.nodes.leader(self.nodes.node):
            sweep(self.root, step, self.keep_local, self.newest_persistent, self.run_id, self._persist_step)
        result = SaveResult(
            step, path, written.blocking_s, time.perf_counter() - started, written.bytes_written
        )
        self.mgr.note_save(result)
        return result

    def _persist_later(self, step: int, final: Path, raw: bytes, m: Any) -> None:
        """A memory step's copy to the root, in a thread of its own at low CPU priority, beside the next saves
        (which reuse the other arena meanwhile: module memory); one at a time, its error raised at the next
        ``wait``."""
        assert self.stager is not None
        self._join_persist(raise_error=False)
        slot = self.stager.pin()
        self._persist_step = step

        def run() -> None:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except (OSError, AttributeError):
                pass
            try:
                replicate.persist(self.pcoll, self.mgr.storage, step, final, raw, m)
                self.newest_persistent = step
                if self.coll.rank == 0:
                    try:
                        self.mgr.apply_retention(step)
                    except Exception as e:  # noqa: BLE001 - the step is committed; housekeeping must not undo it
                        warnings.warn(f"after committing step {step}: {type(e).__name__}: {e}", stacklevel=1)
            except BaseException as e:  # noqa: BLE001 - raised by the next wait()
                self._persist_error = e
            finally:
                assert self.stager is not None
                self.stager.unpin(slot)
                self._persist_step = None

        self._persisting = threading.Thread(target=run, name="ckpt-persist", daemon=True)
        self._persisting.start()

    def _join_persist(self, raise_error: bool = True) -> None:
        t, self._persisting = self._persisting, None
        if t is not None:
            t.join()
        err, self._persist_error = self._persist_error, None
        if err is not None:
            if raise_error:
                raise err
            self._persist_error = err

    def wait(self) -> SaveResult | None:
        """Block until the in-flight local save (and its replicas, its persistent copy) is done; raise its error
        once."""
        try:
            return self._wait_local()
        finally:
            self._join_persist()

    def _wait_local(self) -> SaveResult | None:
        """:meth:`wait`, less a memory step's copy to the root (which runs at its own pace)."""
        err, self._persist_error = self._persist_error, None
        if err is not None:
            raise err
        fut, self._fut = self._fut, None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if fut is None:
            return self.mgr.checkpointer.wait()
        return fut.result()

    # ------------------------------------------------------------------------------------------------ restoring
    def restore_latest(self, state: dict[str, Any]) -> int | None:
        """Restore the newest step of this run complete in any tier (module docstrings of :mod:`.agree`); its
        step, or None.  Every step of the collective agreement ends on every rank with the first failing rank's
        reason when one rank fails unexpectedly (:func:`~ckpt.distributed.agreed`), never in a wait."""
        self.wait()
        self.mgr.checkpointer.staged()
        t0 = time.perf_counter()
        rid = self.run_id

        def look() -> tuple[dict[int, dict[str, Any]], list[str]]:
            mine = agree.inventory(self.nodes, self.root, rid) if rid is not None else {}
            return mine, runid.foreign_steps(self.local_dir, rid) if self.leader else []

        parts = agreed(self.coll, "restore_latest: the local tier's inventory", look)
        reports = [r for r, _ in parts]
        foreign = [f for _, fs in parts for f in fs]
        if foreign:
            self._warn(
                f"not restoring {len(foreign)} local step(s) of other runs (this run: {rid or 'none recorded yet'}"
                f"; never deleted by this run): {', '.join(foreign[:6])}"
                + (f", and {len(foreign) - 6} more" if len(foreign) > 6 else "")
            )
        (candidates, *_) = agreed(self.coll, "restore_latest: planning", lambda: self._plan(reports))
        boxes = _live_boxes(state.get("model"), self.mgr.layout_hook)
        for cand in candidates:
            if not cand.tier:
                warnings.warn(f"skipping {cand.note}", stacklevel=3)
                continue
            if cand.tier == PERSISTENT:
                path, tier, job_tier = self.mgr.path_for(cand.step), PERSISTENT, PERSISTENT
            else:
                assert rid is not None
                agreed(
                    self.coll,
                    "restore_latest: this run's folder",
                    lambda: runid.ensure_local(self.local_dir, rid, self.mgr.root) if self.leader else None,
                )
                problems = agree.fetch(self.coll, self.nodes, self.root, cand, boxes)
                if problems:
                    warnings.warn(
                        f"local step {cand.step}: fetching replicas failed, falling back: {problems[0]}",
                        stacklevel=3,
                    )
                    continue
                path, tier = str(self.root / step_dir(cand.step)), cand.tiers[self.coll.rank]
                job_tier = max(cand.tiers, key=lambda t: _RANK[t])
            result = self.mgr.restore_agreed(
                path, cand.step, state, t0, tier=tier, job_tier=job_tier, verify=not cand.checked
            )
            if result is not None:
                if cand.tier == PERSISTENT:
                    self.newest_persistent = cand.step
                return cand.step
        return None

    def _plan(self, reports: list[dict[int, dict[str, Any]]]) -> list[agree.Candidate] | None:
        """Rank 0: the candidates (:func:`.agree.plan`); None on the other ranks."""
        if self.coll.rank != 0:
            return None
        try:
            persistent = [i.step for i in self.mgr.list() if i.status == "committed"]
        except (CkptError, OSError) as e:  # the object store down: the local tier can still restore
            warnings.warn(
                f"cannot list the persistent tier, restoring from local steps only: {e}", stacklevel=5
            )
            persistent = []
        return agree.plan(self.nodes, reports, persistent)


def _live_boxes(model: Any, layout_hook: Any) -> dict[str, Any] | None:
    """The box of every model tensor this rank holds (what a restore reads of it); None when a layout hook or no
    model decides that (a fetch then brings every file)."""
    if model is None or layout_hook is not None:
        return None
    from ..state.training import local_box, model_tensors

    try:
        return {nt.name: local_box(nt.tensor)[1] for nt in model_tensors(model)}
    except CkptError:
        return None
