"""CheckpointManager: the object a training loop keeps — save every N steps, restore the latest, retention.

It composes the pieces and owns only policy: where step folders go, which checkpoint is "latest" (the newest
committed one whose files are all present; a damaged newest one, or a newer step folder without a manifest, is
skipped with a warning), and what to delete.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .distributed import Collective
from .errors import (
    BaseMismatchError,
    CkptError,
    CorruptionError,
    ManifestError,
    StateMismatchError,
    StorageError,
)
from .format.manifest import MANIFEST_NAME
from .format.reader import CheckpointReader
from .restoring.discovery import CheckpointInfo, list_checkpoints, missing_files, parse_step, step_dir
from .restoring.loader import RestoreResult, restore
from .saving.checkpointer import Checkpointer, SaveResult, check_step
from .saving.options import SaveOptions, split_keywords
from .storage import open_storage
from .tiers.policy import TierPolicy
from .tiers.tiered import Tiers

# a checkpoint that is damaged or incomplete: restore_latest falls back to an older one
_DAMAGE = (CorruptionError, ManifestError, StorageError)


class CheckpointManager:
    """Periodic checkpoints under ``root`` (a local path or an fsspec URL such as ``s3://bucket/run``).

    ``keep_last=k`` keeps the k newest checkpoints; ``keep_every=n`` also keeps every step divisible by n.
    Construct on every rank.

    Tiers (:mod:`ckpt.tiers`): with ``local_dir`` (a node-local folder: NVMe, ``/dev/shm``), steps divisible by
    ``local_every`` are saved there, each rank's files copied to ``replicas`` peer nodes (node identity from
    torchrun's ``GROUP_RANK``, or ``node_rank=``), and steps divisible by ``persist_every`` also go to ``root``;
    ``save`` is a no-op for other steps.  ``keep_local`` local steps are kept per node.  ``restore_latest`` restores
    the newest step complete in any tier; ``last_restore.tier`` says from where.  Without ``local_dir``,
    ``persist_every`` alone thins the saves to ``root``.  ``local_memory=True`` (``local_dir`` on ``/dev/shm``) makes
    the local tier a host-memory tier (:mod:`ckpt.tiers.memory`): a save is one copy into shared memory, the
    persistent copies run in the background at their own pace.
    """

    def __init__(
        self,
        root: str,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_save: bool = True,
        storage_options: dict[str, Any] | None = None,
        codec: str = "raw",
        process_group: Any = None,
        layout_hook: Any = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        digest_restores: bool = True,
        local_dir: str | None = None,
        local_every: int | None = None,
        persist_every: int | None = None,
        replicas: int = 0,
        keep_local: int | None = 2,
        node_rank: int | None = None,
        local_memory: bool = False,
        **checkpointer_options: Any,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise CkptError(f"keep_last={keep_last}: expected at least 1 (or None to keep all)")
        self.root = str(root).rstrip("/")
        self.storage = open_storage(self.root, storage_options)
        self.storage_options = storage_options
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.layout_hook = layout_hook
        self.on_event = on_event
        #: restore events carry the model's digest right after the restore (``on_event`` only, rank 0)
        self.digest_restores = digest_restores
        self.checkpointer = Checkpointer(
            async_save=async_save,
            process_group=process_group,
            codec=codec,
            storage_options=storage_options,
            layout_hook=layout_hook,
            **checkpointer_options,
        )
        self.coll: Collective = self.checkpointer.coll
        self.last_result: SaveResult | None = None
        #: save-time facts by step (``ckpt.state.save_facts``), taken when a save is requested, emitted at commit
        self._save_facts: dict[int, dict[str, Any]] = {}
        #: the RestoreResult of the last restore / restore_latest on this rank (data position, RNG streams, ...)
        self.last_restore: RestoreResult | None = None
        self.policy = TierPolicy(local_dir is not None, local_every, persist_every)
        self.tiers: Tiers | None = None
        if local_dir is not None:
            if process_group is not None:
                raise CkptError(
                    "local_dir= with process_group=: the tiers' group spans every rank of the job"
                )
            self.tiers = Tiers(self, local_dir, self.policy, replicas, keep_local, node_rank, local_memory)
        elif local_memory:
            raise CkptError(
                "local_memory=True needs local_dir= (a folder in host memory, e.g. /dev/shm/ckpt)"
            )

    def path_for(self, step: int) -> str:
        return f"{self.root}/{step_dir(step)}"

    # ------------------------------------------------------------------------------------------------ saving
    def save(self, step: int, **state: Any) -> Future:
        """Save ``state`` as step ``step`` to the tiers the policy names (a no-op for the others: the future's
        result is None): the training objects (model=, optimizer=, scheduler=, ...) and the
        :class:`~ckpt.SaveOptions` fields as plain keywords (progress=, lazy=, adapter_only=, ...); see
        Checkpointer.save.  ``on_commit`` is the manager's own (retention, ``on_event``)."""
        check_step(step)
        objects, options = split_keywords(state, "CheckpointManager.save")
        if options.on_commit is not None:
            raise TypeError("CheckpointManager.save() got on_commit=: the manager commits with its own (retention); "
                            "use CheckpointManager(on_event=...) to hear of saves")  # fmt: skip
        if self.tiers is None and not self.policy.tiers(step):
            fut: Future = Future()
            fut.set_result(None)
            return fut
        self._take_save_facts(step, objects, options)
        if self.tiers is not None:
            return self.tiers.save(step, objects, options)
        return self.save_persistent(step, objects, options)

    def _take_save_facts(self, step: int, objects: dict[str, Any], options: SaveOptions) -> None:
        """The save event's facts, taken now on the training thread, before any staging: the RNG state the
        checkpoint captures and a fingerprint of the live weights (:mod:`ckpt.state.save_facts`), so that
        verify-resume can tell a restore that skipped the RNG, or a checkpoint written from other weights than
        these, without overlapping steps.  Only for a listener, on rank 0."""
        if self.on_event is None or self.coll.rank != 0:
            return
        from .state.save_facts import take

        facts, seconds = take(None if options.adapter_only else objects.get("model"), rng=options.rng)
        self._save_facts[int(step)] = {**facts, "facts_s": seconds}

    def save_persistent(self, step: int, objects: dict[str, Any], options: SaveOptions) -> Future:
        """Save step ``step`` to ``root`` only."""
        options = dataclasses.replace(options, on_commit=self._after_commit)
        fut = self.checkpointer.save(self.path_for(step), step=step, options=options, **objects)
        if fut.done() and fut.exception() is None:
            self._emit_save(fut.result())
        return fut

    def _after_commit(self, result: SaveResult) -> None:
        self.last_result = result
        if self.checkpointer.async_save:
            self._emit_save(result)
        self.apply_retention(result.step)

    def note_save(self, result: SaveResult) -> None:
        """A save committed by the tiers (every rank): recorded and reported like one of ``root``."""
        self.last_result = result
        self._emit_save(result)

    def _emit_save(self, result: SaveResult) -> None:
        if self.on_event is not None and self.coll.rank == 0:
            facts = self._save_facts.pop(result.step, {})
            # a save that never committed leaves its facts behind: drop those of older steps
            self._save_facts = {s: f for s, f in self._save_facts.items() if s > result.step}
            self.on_event(
                "save",
                {
                    "step": result.step,
                    "path": result.path,
                    "blocking_s": result.blocking_s,
                    "total_s": result.total_s,
                    "bytes": result.bytes_written,
                    **facts,
                },
            )

    def wait(self) -> SaveResult | None:
        if self.tiers is not None:
            return self.tiers.wait()
        return self.checkpointer.wait()

    def staged(self) -> None:
        """Wait until the in-flight save no longer reads training tensors (see :meth:`Checkpointer.staged`)."""
        self.checkpointer.staged()

    def close(self) -> None:
        try:
            if self.tiers is not None:
                self.tiers.wait()
        finally:
            self.checkpointer.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ listing
    def list(self, check_files: bool = False) -> list[CheckpointInfo]:
        return list_checkpoints(self.storage, check_files)

    def latest_step(self) -> int | None:
        committed = [i for i in self.list() if i.status == "committed"]
        return committed[-1].step if committed else None

    # ------------------------------------------------------------------------------------------------ restoring
    def restore(self, step: int, **state: Any) -> RestoreResult:
        self.checkpointer.staged()  # a lazily staged save must have read the tensors this restore overwrites
        t0 = time.perf_counter()
        result = restore(
            self.path_for(step), storage_options=self.storage_options, layout_hook=self.layout_hook, **state
        )
        self._emit_restore(result, time.perf_counter() - t0, state.get("model"))
        return result

    def _emit_restore(
        self,
        result: RestoreResult,
        seconds: float,
        model: Any = None,
        tier: str = "persistent",
        job_tier: str = "",
    ) -> None:
        # seconds: wall time of the restore including manifest reads, so recovery-cost reports can use it
        self.last_restore = result = dataclasses.replace(result, tier=tier)
        if self.on_event is not None and self.coll.rank == 0:
            info: dict[str, Any] = {"step": result.step, "path": result.path, "seconds": seconds}
            info["tier"] = job_tier or tier
            if model is not None and self.digest_restores:
                digest = self._restored_digest(result, model)
                info.update(model_digest=digest.tensors, model_views=digest.views)
            if result.unexpected and result.missing:  # strict=False: names that did not match were not loaded
                info.update(unloaded=list(result.unexpected), unfilled=list(result.missing))
            if not result.rng_derived:  # after a change of DP size streams are re-derived by design
                from .state.save_facts import rng_digests

                # the live RNG as the restore left it: equal to the save event's where the streams were carried
                info["rng_digests"] = rng_digests()
            self.on_event("restore", info)

    def _restored_digest(self, result: RestoreResult, model: Any) -> Any:
        """The model's digest right after the restore (``LiveDigest``), hashed in the restored checkpoint's chunk
        boxes and view, so that it equals the checkpoint's own digest (made from its stored checksums) iff the
        weights were restored.  One read of the model on rank 0 (xxh3 at memory speed; a device model is copied to
        the host tensor by tensor)."""
        from .converters.digest import live_digest
        from .format.reader import read_manifest

        m = result.manifest
        if m.v2 is not None and not any(e.shards for e in m.tensors.values()):
            m = read_manifest(open_storage(result.path, self.storage_options))  # the chunks: every index
        return live_digest(model, m)

    def restore_latest(self, **state: Any) -> int | None:
        """Restore the newest valid checkpoint; returns its step, or None when there is none. Call on every rank.

        Rank 0 picks candidates (newest first); every rank restores; if any rank finds damage (missing file,
        checksum, unreadable manifest), all ranks fall back to the previous checkpoint together, with a warning
        naming the problem.  A checkpoint that does not fit the caller's objects (other shapes or names, an
        optimizer the checkpoint does not hold) raises :class:`StateMismatchError` on every rank at once: an older
        step would not fit either, and returning None would silently restart training from scratch.
        """
        if self.tiers is not None:
            return self.tiers.restore_latest(state)
        self.checkpointer.staged()
        t0 = time.perf_counter()
        candidates = None
        if self.coll.rank == 0:
            candidates = []
            for info in reversed(self.list()):
                if info.status == "uncommitted":
                    if not candidates:
                        # newer than anything restorable: an interrupted save, or a committed checkpoint whose
                        # manifest was deleted; the two look alike, so say so rather than skip it silently
                        warnings.warn(
                            f"skipping step {info.step}: {info.name} has no {MANIFEST_NAME} "
                            "(an interrupted save, or its manifest was deleted)",
                            stacklevel=2,
                        )
                    continue
                if info.status == "damaged":
                    warnings.warn(f"skipping damaged checkpoint step {info.step}: {info.error}", stacklevel=2)
                    continue
                assert info.manifest is not None
                bad = missing_files(self.storage.child(info.name), info.manifest)
                if bad:
                    warnings.warn(
                        f"skipping damaged checkpoint step {info.step}: {', '.join(bad[:4])}", stacklevel=2
                    )
                    continue
                candidates.append(info.step)
        candidates = self.coll.broadcast(candidates)
        for step in candidates:
            if self.restore_agreed(self.path_for(step), step, state, t0) is not None:
                return step
        return None

    def restore_agreed(
        self,
        path: str,
        step: int,
        state: dict[str, Any],
        t0: float,
        tier: str = "persistent",
        job_tier: str = "",
        verify: bool = True,
    ) -> RestoreResult | None:
        """Restore step ``step`` from ``path`` on every rank; None (with a warning) when any rank found damage, so
        that all fall back together.  A checkpoint that does not fit the caller's objects raises on every rank.
        ``verify=False``: the data files' checksums were just checked (a local tier's inventory)."""
        error: tuple[Any, ...] | None = (
            None  # (is_mismatch: None when unexpected, message[, is_base_mismatch])
        )
        unexpected: BaseException | None = None
        options = self.storage_options if tier == "persistent" else None
        try:
            reader = CheckpointReader(path, options, verify)
            result = restore(reader, layout_hook=self.layout_hook, **state)
        except _DAMAGE as e:
            error = (False, str(e))
        except CkptError as e:
            # the caller's objects do not fit (StateMismatchError, BaseMismatchError, LayoutError, ...): not the
            # checkpoint's fault, and older steps would not fit either
            error = (True, str(e), isinstance(e, BaseMismatchError))
        except Exception as e:  # noqa: BLE001 - unexpected: every rank ends with it at once, none waits for it
            error, unexpected = (None, f"{type(e).__name__}: {e}"), e
        gathered = self.coll.all_gather(error)
        failed = [(r, e[1]) for r, e in enumerate(gathered) if e is not None and e[0] is None]
        if failed:
            rank, reason = failed[0]
            raise CkptError(
                f"restoring step {step} from {path}: rank {rank} failed: {reason}"
            ) from unexpected
        errors = [e for e in gathered if e is not None]
        mismatches = [(msg, base) for is_mismatch, msg, *base in errors if is_mismatch]
        if mismatches:
            msg, base = mismatches[0]
            cls = BaseMismatchError if base and base[0] else StateMismatchError
            raise cls(
                f"{msg} (checkpoint step {step} does not fit the objects passed to restore_latest; "
                "older steps were not tried, so training does not silently restart)"
            )
        if errors:
            warnings.warn(
                f"checkpoint step {step} could not be restored, falling back: {errors[0][1]}",
                stacklevel=3,
            )
            return None
        self._emit_restore(result, time.perf_counter() - t0, state.get("model"), tier, job_tier)
        return self.last_restore

    # ------------------------------------------------------------------------------------------------ retention
    def apply_retention(self, newest: int) -> list[int]:
        """Delete checkpoints outside the policy (manifest first) and sweep leftovers. Returns deleted steps.

        ``newest`` is the step just written.  Steps above it belong to another run (an older timeline left in
        the same root): they are never deleted and do not count towards ``keep_last``, so they cannot push the
        writing run's own checkpoints out.
        """
        infos = self.list()
        committed = [i.step for i in infos if i.status == "committed" and i.step <= newest]
        keep = set(committed if self.keep_last is None else committed[-self.keep_last :])
        if self.keep_every:
            keep |= {s for s in committed if s % self.keep_every == 0}
        keep.add(newest)
        keep |= {i.step for i in infos if i.step > newest}
        deleted = []
        for info in infos:
            sub = self.storage.child(info.name)
            if info.status == "committed" and info.step not in keep:
                sub.delete(MANIFEST_NAME)
                self.storage.delete_tree(info.name)
                deleted.append(info.step)
            elif info.status == "uncommitted" and info.step < newest:
                # only folders without a manifest are leftovers; a "damaged" one has a manifest this process
                # could not read (a newer format, a transient error) and is never deleted on that basis
                self.storage.delete_tree(info.name)
        newest_info = next((i for i in infos if i.step == newest), None)
        if newest_info is not None and newest_info.manifest is not None:
            sub = self.storage.child(newest_info.name)
            m = newest_info.manifest
            indexes = {e.path for e in m.v2.sealed_files()} if m.v2 is not None else set()
            referenced = set(m.files) | indexes | {MANIFEST_NAME}
            for name in sub.listdir():
                if name not in referenced:
                    sub.delete(name)
        # uploads under a later step may be that step's save at work on another rank: only older ones are stale
        self.storage.abort_stale_uploads(live=lambda path: _step_of(path) > newest)
        return deleted


def _step_of(path: str) -> int:
    """The step of the folder ``path`` lies in (``step_<N>/...``), or -1 when it lies in none."""
    step = parse_step(path.split("/", 1)[0])
    return -1 if step is None else step
