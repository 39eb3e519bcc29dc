"""Sharded, synchronous or asynchronous saving on every rank, with the manifest written last by rank 0.

Call order (every rank calls :meth:`Checkpointer.save` with the same path and step):

1. capture (:mod:`.capture`): flatten model / optimizer into named tensors and the rest into JSON trees (cheap);
2. plan (collective, :mod:`.writers`): each rank derives the replica group of every piece from its placements and
   computes its share of the writes alone (planning.plan_local); one all-reduce of two numbers proves all ranks
   agreed.  When a piece has no derivable group or the check fails, the exact path runs: digests all-gathered, and
   when they changed since the last save the descriptions too, each rank computing the same assignment
   (planning.assign_writers);
3. stage (async only, :mod:`.lazy`): record this rank's assigned tensors for the host copy.  ``save`` returns here.
   Lazy staging (the async default) copies the tensors the optimizer owns in the background while training
   continues; a ``register_step_pre_hook`` on that optimizer holds the next ``step()`` until they are copied.
   Everything else (buffers, frozen weights, XLA tensors) is copied before ``save`` returns (see
   :meth:`Checkpointer.staged`);
4. write (background thread when async, :mod:`.commit`): one safetensors data file per rank under the checkpoint
   prefix;
5. commit (collective, :mod:`.commit`): format 2 (the default): each rank seals its own index and state file and
   sends rank 0 their checksums and the boxes it wrote; format 1: its receipt (every chunk) and trees; or its error.
   Rank 0 publishes ``manifest.json`` (:func:`ckpt.format.publish.publish`) iff every rank succeeded, then tells
   every rank the outcome.

A failure anywhere means no manifest, hence no checkpoint; an async failure is raised at the next
``save``/``wait``/``close``.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed import Collective
from ..errors import AsyncSaveError, CheckpointExistsError, CkptError
from ..format import publish
from ..format.manifest import MANIFEST_NAME
from ..state import adapters
from ..state.rng import capture as rng_capture
from ..state.training import NamedTensor, optimizer_capture
from ..storage import open_storage
from .capture import capture, check_step, default_layout, detect_backend
from .commit import SaveJob, SaveResult, run
from .lazy import Guards, lazy_flags
from .options import SaveOptions
from .planning import DEFAULT_CHUNK_BYTES
from .process_writer import default_stager
from .staging import Staged
from .worker import Job, Worker
from .writers import LayoutHook, WriterPlanner, chunks_of


@dataclass(frozen=True)
class StagingInfo:
    """How the last save staged its tensors: bytes copied in the background (``lazy_bytes``) and before
    ``save`` returned (``eager_bytes``), and why any were copied eagerly (``None`` when all were lazy)."""

    lazy_bytes: int
    eager_bytes: int
    reason: str | None


class Checkpointer:
    """Saves checkpoints from a training loop. Construct on every rank (it creates the checkpoint process group).

    ``async_save=True`` returns from :meth:`save` without copying the state the optimizer owns (``lazy=True``, the
    default): a helper thread (CPU) or a side CUDA stream copies it while the next forward and backward run, and a
    step pre-hook installed on the optimizer holds its next ``step()`` until the copy is done.  Code that edits
    saved tensors outside ``optimizer.step()`` calls :meth:`staged` first (or saves with ``lazy=False``, which
    copies everything before returning).  One save is in flight at a time; ``close()`` waits for it.  On Linux the
    data files of an async save to a local folder are hashed and written by a persistent writer process reading the
    staging arena in shared memory (:mod:`ckpt.saving.process_writer`), so none of that work takes the training
    process's GIL; ``stager=HostStager()`` writes them from a thread of this process instead.

    Replicated state (a box of a tensor that several ranks hold: DDP replicas, TP-replicated norms) is written by one
    rank only, so its copies are compared first (:mod:`ckpt.saving.replicated`: an all-reduce of hashes of xxh3 digests within
    each replica group; the digests are all-gathered only to name a difference):
    on the first save of this checkpointer, and on every save when ``verify_replicas=True`` here or in
    :meth:`save`.  A copy that differs refuses the save on every rank (``ReplicaMismatchError``), nothing written.
    """

    def __init__(
        self,
        *,
        async_save: bool = False,
        process_group: Any = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        codec: str = "raw",
        storage_options: dict[str, Any] | None = None,
        layout_hook: LayoutHook | None = None,
        stager: Any = None,
        verify_replicas: bool = False,
        format_version: int | None = None,
        lazy: bool = True,
    ) -> None:
        if format_version not in (None, 1, 2):
            raise CkptError(
                f"format_version={format_version!r}: expected 1 or 2 (default: ckpt.FORMAT_VERSION)"
            )
        self.async_save = async_save
        self.lazy = lazy
        self.verify_replicas = verify_replicas
        self._replicas_checked = False
        #: recorded as every manifest's ``run_id`` when set (a CheckpointManager with tiers: ckpt.tiers.runid)
        self.run_id: str | None = None
        self.coll = Collective(process_group)
        self.chunk_bytes = chunk_bytes
        self.codec = codec
        self.storage_options = storage_options
        self.layout_hook = layout_hook
        self.stager = stager or default_stager(async_save)
        self.format_version = format_version  # None: ckpt.FORMAT_VERSION
        self._writers = WriterPlanner(self.coll)
        self._inflight: Future | None = None
        self._thread: Job | None = None
        self._worker = Worker(
            "ckpt-writer"
        )  # one thread across saves: no thread start on the training thread
        self._base = adapters.BaseTracker()
        self._staged: Staged | None = None  # copies the training thread must wait for before mutating
        self._guards = Guards()
        self.last_staging: StagingInfo | None = None
        #: seconds the training thread waited in step / load_state_dict hooks and staged() (benches, tests)
        self.hook_wait_s = 0.0

    @property
    def last_plan(self) -> str:
        """``"local"`` or ``"exact"``: how the last save agreed on its writers (tests, benches)."""
        return self._writers.last_plan

    # ------------------------------------------------------------------------------------------------ public
    def save(
        self,
        path: str,
        *,
        step: int,
        model: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        dataloader: Any = None,
        tokenizer: Any = None,
        options: SaveOptions | None = None,
    ) -> Future:
        """Save one checkpoint to ``path`` (its own directory/prefix). Returns a future of :class:`SaveResult`.

        Synchronous saves are complete (and raise) before returning; the future is already resolved.
        The training objects are keywords; everything else (RNG, progress, layout, overwrite, adapter-only, lazy
        staging, ...) is ``options`` (:class:`~ckpt.saving.options.SaveOptions`, whose docstring says what each
        does; ``CheckpointManager.save`` and ``ckpt.save`` take them as plain keywords).
        ``dataloader``: each rank's ``state_dict`` plus, for loaders a data adapter knows (ckpt.data), the global
        data position that a restore on another DP size continues.
        ``adapter_only`` saves are described in :mod:`ckpt.state.adapters`; save the base itself once with a plain
        save when it is not on storage already.  ``last_staging`` says what an async save copied how, and why
        anything was copied eagerly.
        """
        opts = options if options is not None else SaveOptions()
        check_step(step)
        self.wait()
        started = time.perf_counter()
        storage = open_storage(path, self.storage_options)
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler,
                 "dataloader": dataloader, "tokenizer": tokenizer}  # fmt: skip
        cap = capture(step, state, opts, self.capture_optimizer, self._base, self.capture_rng)
        named, trees = cap.named, cap.trees
        if self.run_id is not None:
            trees["run_id"] = self.run_id

        refused: CkptError | None = None
        try:
            self.check_state(named)
            pieces, local, groups = self._writers.describe(named, self.layout_hook)
        except CkptError as e:
            if not self.coll.active:
                raise
            refused, pieces, local, groups = e, [], {}, []
        rank0 = (
            {"attempt": uuid.uuid4().hex[:8], "exists": storage.exists(MANIFEST_NAME)}
            if self.coll.rank == 0 and refused is None
            else None
        )
        # bytes per rank independent of the world size: rank 0's facts broadcast, refusals counted; the errors
        # (and adapters' base identities) are gathered only when there are any
        info = self.coll.broadcast(rank0)
        (refusals,) = self.coll.all_reduce_sum([0 if refused is None else 1])
        if refusals:
            _agree(refused, self.coll.all_gather(None if refused is None else str(refused)))
        if opts.adapter_only:
            trees["adapter"] = adapters.manifest_record(
                self.coll.all_gather(cap.base), adapters.lora_config(model)
            )
        if info["exists"] and not opts.overwrite:
            raise CheckpointExistsError(
                f"{storage.display(MANIFEST_NAME)} already exists: step {step} is committed (pass overwrite=True)"
            )
        write = self._writers.assign(pieces, groups)
        check = opts.verify_replicas if opts.verify_replicas is not None else self.verify_replicas
        if (check or not self._replicas_checked) and self.coll.world_size > 1:
            self._writers.check_replicas(pieces, groups, local)
            self._replicas_checked = True
        if info["exists"] and self.coll.rank == 0:
            storage.delete(MANIFEST_NAME)
        mine = [(p, local[(p.name, p.box)]) for p, w in zip(pieces, write, strict=True) if w]
        order = {p.name: i for i, p in enumerate(pieces)}
        descs = [(order[d.name], d) for d in {p.name: p.desc for p, _ in mine}.values()]
        chunks = chunks_of(mine, self.chunk_bytes)
        backend = detect_backend([t for _, _, t in chunks] or [n.tensor for n in named])
        staged: Staged | None = None
        if self.async_save or backend != "cpu":
            want = self.async_save and (self.lazy if opts.lazy is None else opts.lazy)
            # where each chunk will lie in the data file, for a stager that writes it from its arena
            offsets = (
                publish.payload_offsets(chunks, publish.data_file_metadata(step, self.coll.rank))
                if self.codec == "raw" and hasattr(self.stager, "write_from_arena")
                else None
            )
            staged = self._stage([t for _, _, t in chunks], backend, want, optimizer, model, offsets)
            host = staged.hosts
        else:
            host = [t.detach().contiguous() for _, _, t in chunks]
        chunks = [(n, b, h) for (n, b, _), h in zip(chunks, host, strict=True)]
        job = SaveJob(
            storage=storage,
            step=step,
            chunks=chunks,
            codec=self.codec,
            descs=descs,
            trees=trees,
            rank_trees=cap.rank_trees,
            layout=opts.layout or default_layout(named, self.coll.world_size),
            backend=backend,
            attempt=info["attempt"],
            started=started,
            blocking_s=0.0,
            on_commit=opts.on_commit,
            rng_seed=opts.rng_seed,
            written=[(p.name, p.box) for p, _ in mine],
            staged=staged,
            write_elsewhere=getattr(self.stager, "write_from_arena", None),
        )
        fut: Future = Future()
        job.blocking_s = time.perf_counter() - started
        if not self.async_save:
            fut.set_result(run(self.coll, job, self.format_version))
            return fut
        self._inflight = fut
        self._thread = self._worker.submit(self._background, job, fut)
        return fut

    def wait(self) -> SaveResult | None:
        """Block until the in-flight save finished; raise its error (once) if it failed."""
        fut, self._inflight = self._inflight, None
        if fut is None:
            return None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._staged = None
        exc = fut.exception()
        if exc is not None:
            if isinstance(exc, CkptError) and not isinstance(exc, AsyncSaveError):
                raise AsyncSaveError(f"background save failed, checkpoint not committed: {exc}") from exc
            raise exc
        return fut.result()

    def close(self) -> None:
        """Wait for the in-flight save (raising its error) and free the staging memory."""
        try:
            self.wait()
        finally:
            self.stager.release()
            self._guards.remove()

    def staged(self) -> None:
        """Return once the in-flight save no longer reads the training tensors: call it before editing saved
        tensors outside ``optimizer.step()`` (EMA updates, weight surgery, ``param.data.copy_``).

        On CPU it waits for the background copy; on CUDA it makes the current stream wait on the copy's event
        (later kernels on that stream run after the copy; the host does not block).  ``optimizer.step()`` and
        ``model.load_state_dict`` do this themselves through the hooks lazy staging installs."""
        s = self._staged
        if s is None:
            return
        t0 = time.perf_counter()
        s.before_mutation()
        self.hook_wait_s += time.perf_counter() - t0
        if not s.pending:
            self._staged = None

    def check_state(self, named: list[NamedTensor]) -> None:
        """Refuse state this checkpointer cannot describe without guessing (an extension point; raises CkptError).
        Called on every rank before anything is exchanged; a refusal on any rank fails the save on every rank."""

    def capture_optimizer(self, optimizer: Any, model: Any) -> tuple[list[NamedTensor], dict[str, Any]]:
        """Named tensors and JSON tree of ``optimizer``.  An extension point: optimizers whose ``state_dict`` is
        not torch.optim's (ZeRO-1 wrappers keep sharded ``base_state``) override it in a subclass."""
        return optimizer_capture(optimizer, model)

    def capture_rng(self) -> dict[str, Any]:
        """This rank's RNG streams as an encoded tree (``rng=True`` saves).  An extension point: a converter that
        writes another process's streams (a Trainer folder's ``rng_state.pth``) overrides it."""
        return rng_capture()

    # ------------------------------------------------------------------------------------------------ internals
    def _stage(
        self,
        tensors: list[torch.Tensor],
        backend: str,
        lazy: bool,
        optimizer: Any,
        model: Any,
        file_offsets: list[int] | None = None,
    ) -> Staged:
        """Start the host copy of ``tensors``: in the background for those the optimizer owns when ``lazy`` and a
        step hook can guard them, before returning for the rest (the reason lands in ``last_staging``)."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        flags, reason = lazy_flags(tensors, sizes, backend, lazy, self.stager, optimizer)
        begin = getattr(self.stager, "begin", None)
        if begin is None:
            staged = Staged(self.stager.stage(tensors))
        else:
            staged = (
                begin(tensors, flags, file_offsets) if file_offsets is not None else begin(tensors, flags)
            )
        lazy_bytes = sum(s for s, f in zip(sizes, flags, strict=True) if f)
        self.last_staging = StagingInfo(lazy_bytes, sum(sizes) - lazy_bytes, reason)
        if any(flags):
            self._guards.install(self, Checkpointer.staged, optimizer, model)
            self._staged = staged
        return staged

    def _background(self, job: SaveJob, fut: Future) -> None:
        try:
            fut.set_result(run(self.coll, job, self.format_version))
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(e)


def _agree(mine: CkptError | None, errors: list[str | None]) -> None:
    """Every rank raises when any rank refused: its own error, else the first refusing rank's."""
    if mine is not None:
        raise mine
    for rank, err in enumerate(errors):
        if err is not None:
            raise CkptError(f"rank {rank} refused the save, nothing written: {err}")


__all__ = [
    "Checkpointer",
    "LayoutHook",
    "SaveOptions",
    "SaveResult",
    "StagingInfo",
    "check_step",
    "default_layout",
    "detect_backend",
]
