"""The tiers of one :class:`~ckpt.manager.CheckpointManager`: local saves with replicas, their persistent copies,
and restores from the newest step complete anywhere (package docstring)."""

from __future__ import annotations

import threading
import time
import uuid
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from ..distributed import Collective, gloo_group
from ..errors import CkptError
from ..restoring.discovery import step_dir
from ..saving.checkpointer import SaveResult
from ..storage import refusal
from . import agree, replicate
from .node import NodeMap
from .policy import LOCAL, PEER, PERSISTENT, TierPolicy
from .retention import PENDING, sweep

# the worst tier any rank restored from names the job's restore (the ledger's record)
_RANK = {LOCAL: 0, PEER: 1, PERSISTENT: 2}


def _tier_group(timeout_s: float = 1800.0) -> Any:
    """A gloo group of its own for the tiers' collectives and transfers, next to the checkpoint group (created
    collectively by the first manager with tiers, then reused; None in one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return gloo_group("tiers", timeout_s)


class Host(Protocol):
    """What the tiers use of their :class:`~ckpt.manager.CheckpointManager` (which imports this module)."""

    checkpointer: Any
    storage: Any

    def save_persistent(self, step: int, objects: dict[str, Any], options: Any) -> Future: ...
    def apply_retention(self, newest: int) -> list[int]: ...
    def note_save(self, result: SaveResult) -> None: ...
    def list(self, check_files: bool = False) -> list[Any]: ...
    def path_for(self, step: int) -> str: ...
    def restore_agreed(
        self, path: str, step: int, state: dict[str, Any], t0: float, tier: str = ..., job_tier: str = ...
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
    ) -> None:
        if keep_local is not None and (isinstance(keep_local, bool) or keep_local < 1):
            raise CkptError(
                f"keep_local={keep_local!r}: expected at least 1 (or None to keep every local step)"
            )
        if "://" in str(local_dir) and not str(local_dir).startswith("file://"):
            raise CkptError(f"local_dir={local_dir!r}: expected a node-local folder (a path), not a URL")
        self.mgr = mgr
        self.root = Path(str(local_dir).removeprefix("file://"))
        self.policy = policy
        self.replicas = replicas
        self.keep_local = keep_local
        self.coll = Collective(_tier_group())
        self.nodes = NodeMap.build(self.coll, node_rank)
        self.nodes.check_replicas(replicas)
        self.newest_persistent: int | None = None
        self._fut: Future | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------------ saving
    def save(self, step: int, objects: dict[str, Any], options: Any) -> Future:
        """Save ``step`` (the training ``objects``, a :class:`~ckpt.SaveOptions`) to the tiers the policy names (a
        resolved future of None when none)."""
        tiers = self.policy.tiers(step)
        if not tiers:
            fut: Future = Future()
            fut.set_result(None)
            return fut
        self.wait()
        if LOCAL not in tiers:
            return self.mgr.save_persistent(step, objects, options)
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
        self._thread = threading.Thread(
            target=self._finish,
            args=(step, tiers, pending, started, written, fut),
            name="ckpt-tiers",
            daemon=True,
        )
        self._thread.start()
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
        problems = [p for ps in self.coll.all_gather(problems) for p in ps]
        final = self.root / step_dir(step)
        if not problems:
            replicate.commit(self.nodes, pending, final)
        self.coll.barrier()
        folder = pending if problems else final
        path = str(final)
        if PERSISTENT in tiers:
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
            sweep(self.root, step, self.keep_local, self.newest_persistent)
        result = SaveResult(
            step, path, written.blocking_s, time.perf_counter() - started, written.bytes_written
        )
        self.mgr.note_save(result)
        return result

    def wait(self) -> SaveResult | None:
        """Block until the in-flight local save (and its replicas, its persistent copy) is done; raise its error
        once."""
        fut, self._fut = self._fut, None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if fut is None:
            return self.mgr.checkpointer.wait()
        return fut.result()

    # ------------------------------------------------------------------------------------------------ restoring
    def restore_latest(self, state: dict[str, Any]) -> int | None:
        """Restore the newest step complete in any tier (module docstrings of :mod:`.agree`); its step, or None."""
        self.wait()
        self.mgr.checkpointer.staged()
        t0 = time.perf_counter()
        reports = self.coll.all_gather(agree.inventory(self.nodes, self.root))
        candidates = None
        if self.coll.rank == 0:
            try:
                persistent = [i.step for i in self.mgr.list() if i.status == "committed"]
            except (CkptError, OSError) as e:  # the object store down: the local tier can still restore
                warnings.warn(
                    f"cannot list the persistent tier, restoring from local steps only: {e}", stacklevel=3
                )
                persistent = []
            candidates = agree.plan(self.nodes, reports, persistent)
        candidates = self.coll.broadcast(candidates)
        for cand in candidates:
            if not cand.tier:
                warnings.warn(f"skipping {cand.note}", stacklevel=3)
                continue
            if cand.tier == PERSISTENT:
                path, tier, job_tier = self.mgr.path_for(cand.step), PERSISTENT, PERSISTENT
            else:
                problems = agree.fetch(self.coll, self.nodes, self.root, cand)
                if problems:
                    warnings.warn(
                        f"local step {cand.step}: fetching replicas failed, falling back: {problems[0]}",
                        stacklevel=3,
                    )
                    continue
                path, tier = str(self.root / step_dir(cand.step)), cand.tiers[self.coll.rank]
                job_tier = max(cand.tiers, key=lambda t: _RANK[t])
            result = self.mgr.restore_agreed(path, cand.step, state, t0, tier=tier, job_tier=job_tier)
            if result is not None:
                if cand.tier == PERSISTENT:
                    self.newest_persistent = cand.step
                return cand.step
        return None
