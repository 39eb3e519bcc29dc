"""Sharded, synchronous or asynchronous saving on every rank, with the manifest written last by rank 0.

Call order (every rank calls :meth:`Checkpointer.save` with the same path and step):

1. capture: flatten model / optimizer into named tensors and the rest into JSON trees (cheap);
2. plan (collective): each rank derives the replica group of every piece from its placements and computes its
   share of the writes alone (planning.plan_local); one all-reduce of two numbers proves all ranks agreed.  When
   a piece has no derivable group or the check fails, the exact path runs: digests all-gathered, and when they
   changed since the last save the descriptions too, each rank computing the same assignment
   (planning.assign_writers);
3. stage (async only): record this rank's assigned tensors for the host copy.  ``save`` returns here.  Lazy
   staging (the async default) copies the tensors the optimizer owns in the background while training continues;
   a ``register_step_pre_hook`` on that optimizer holds the next ``step()`` until they are copied.  Everything
   else (buffers, frozen weights, XLA tensors) is copied before ``save`` returns (see :meth:`Checkpointer.staged`);
4. write (background thread when async): one safetensors data file per rank under the checkpoint prefix;
5. commit (collective): format v2 (the default): each rank seals its own index and state file and sends rank 0
   their checksums and the boxes it wrote (ckpt.format.seal); format v1: its receipt (every chunk) and trees; or its
   error.  Rank 0 writes ``manifest.json`` create-only iff every rank succeeded, then tells every rank the outcome.

A failure anywhere means no manifest, hence no checkpoint; an async failure is raised at the next
``save``/``wait``/``close``.
"""

from __future__ import annotations

import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .. import data as data_mod
from ..distributed import Collective
from ..errors import AsyncSaveError, CheckpointExistsError, CkptError, StateMismatchError
from ..format import treecodec
from ..format.dtypes import dtype_name
from ..format.index import DEFAULT_FORMAT_VERSION
from ..format.manifest import MANIFEST_NAME, Box, Layout, Manifest, TensorDesc
from ..format.publish import Receipt, build_manifest, data_file_name, publish, write_data_file
from ..format.seal import build_top, write_rank_files
from ..state import rng as rng_mod
from ..state import rng_rule
from ..state import tokenizer as tokenizer_mod
from ..state.training import NamedTensor, model_tensors, optimizer_capture, state_dict_of
from ..storage import Storage, open_storage
from ..words import count
from . import adapters
from .planning import (
    DEFAULT_CHUNK_BYTES,
    Group,
    HeldBox,
    assign_writers,
    chunk_boxes,
    digest,
    dtensor_group,
    local_box,
    plan_check,
    plan_local,
    world_group,
)
from .replicated import check_replica_groups, check_replicas, replicated_keys
from .staging import HostStager, Staged

# A layout hook: given a named tensor, return (global shape, local box, local tensor, partition metadata) when the
# tensor is a shard of a bigger logical tensor that plain torch cannot describe (NxD TP shards), else None.
LayoutHook = Callable[
    [NamedTensor], "tuple[tuple[int, ...], Box, torch.Tensor, dict[str, Any] | None] | None"
]


@dataclass(frozen=True)
class SaveResult:
    step: int
    path: str
    blocking_s: float
    total_s: float
    bytes_written: int


@dataclass(frozen=True)
class StagingInfo:
    """How the last save staged its tensors: bytes copied in the background (``lazy_bytes``) and before
    ``save`` returned (``eager_bytes``), and why any were copied eagerly (``None`` when all were lazy)."""

    lazy_bytes: int
    eager_bytes: int
    reason: str | None


@dataclass
class _Job:
    storage: Storage
    step: int
    chunks: list[tuple[str, Box, torch.Tensor]]
    codec: str
    descs: list[
        tuple[int, TensorDesc]
    ]  # (position in this rank's state, description) of every tensor it writes
    trees: dict[str, Any]
    rank_trees: dict[str, Any]
    layout: Layout
    backend: str
    attempt: str
    started: float
    blocking_s: float
    on_commit: Callable[[SaveResult], None] | None = None
    rng_seed: int | None = None
    written: list[tuple[str, Box]] | None = None  # the boxes this rank writes, before chunking (format v2)
    staged: Staged | None = None


def detect_backend(tensors: list[torch.Tensor]) -> str:
    types = {t.device.type for t in tensors}
    if "xla" in types:
        return "neuron"
    if "cuda" in types:
        return "cuda"
    return "cpu"


def check_step(step: Any) -> int:
    """A step is a non-negative integer (it names the folder ``step_%08d`` and orders checkpoints)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        try:
            ok = not isinstance(step, bool) and step.__index__() >= 0
        except (AttributeError, TypeError):
            ok = False
        if not ok:
            raise CkptError(f"step={step!r}: expected a non-negative integer")
    return int(step)


class Checkpointer:
    """Saves checkpoints from a training loop. Construct on every rank (it creates the checkpoint process group).

    ``async_save=True`` returns from :meth:`save` without copying the state the optimizer owns (``lazy=True``, the
    default): a helper thread (CPU) or a side CUDA stream copies it while the next forward and backward run, and a
    step pre-hook installed on the optimizer holds its next ``step()`` until the copy is done.  Code that edits
    saved tensors outside ``optimizer.step()`` calls :meth:`staged` first (or saves with ``lazy=False``, which
    copies everything before returning).  One save is in flight at a time; ``close()`` waits for it.

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
                f"format_version={format_version!r}: expected 1 or 2 (default: ckpt.format.index.DEFAULT_FORMAT_VERSION)"
            )
        self.async_save = async_save
        self.lazy = lazy
        self.verify_replicas = verify_replicas
        self._replicas_checked = False
        self.coll = Collective(process_group)
        self.chunk_bytes = chunk_bytes
        self.codec = codec
        self.storage_options = storage_options
        self.layout_hook = layout_hook
        self.stager = stager or HostStager()
        self.format_version = format_version  # None: ckpt.format.index.DEFAULT_FORMAT_VERSION
        self._plan_key: list[str] | None = None
        self._plan: dict[tuple[str, Box], int] | None = None
        self._per_rank: list[list[HeldBox]] | None = None  # the exact path's gathered pieces
        self.last_plan = ""  # "local" or "exact": how the last save agreed on its writers (tests, benches)
        self._inflight: Future | None = None
        self._thread: threading.Thread | None = None
        self._base = adapters.BaseTracker()
        self._staged: Staged | None = None  # copies the training thread must wait for before mutating
        self._hooked: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._hooked_strong: dict[int, tuple[Any, Any]] = {}
        self.last_staging: StagingInfo | None = None
        #: seconds the training thread waited in step / load_state_dict hooks and staged() (benches, tests)
        self.hook_wait_s = 0.0

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
        rng: bool = True,
        rng_seed: int | None = None,
        progress: dict[str, Any] | None = None,
        metadata: Any = None,
        layout: Layout | None = None,
        extra: dict[str, Any] | None = None,
        overwrite: bool = False,
        on_commit: Callable[[SaveResult], None] | None = None,
        verify_replicas: bool | None = None,
        adapter_only: bool = False,
        base_source: str | None = None,
        lazy: bool | None = None,
    ) -> Future:
        """Save one checkpoint to ``path`` (its own directory/prefix). Returns a future of :class:`SaveResult`.

        Synchronous saves are complete (and raise) before returning; the future is already resolved.
        ``on_commit`` runs on rank 0 after the manifest is written (retention uses it); its errors only warn.
        ``extra`` becomes the manifest's ``extra`` (JSON; backend/converter facts such as ``extra.nxd``).
        ``dataloader``: each rank's ``state_dict`` plus, for loaders a data adapter knows (ckpt.data), the global
        data position that a restore on another DP size continues.  ``rng_seed``: the base seed from which a
        restore on another DP size re-derives per-rank RNG streams (default: derived from rank 0's RNG state).
        ``verify_replicas``: compare replicated copies across ranks in this save (default: on the first save of this
        checkpointer, or always if it was made with ``verify_replicas=True``).
        ``adapter_only=True`` (a fine-tune of a frozen base: PEFT, NxD ``LoraModel``) saves the trainable parameters
        only, with their optimizer state, and records the frozen base by identity in ``manifest.adapter``
        (:mod:`ckpt.saving.adapters`; ``base_source`` says where the base was loaded from, default: its config's
        ``_name_or_path``).  Save the base itself once with a plain save when it is not on storage already.
        ``lazy`` (async saves; default: the checkpointer's ``lazy``): copy the optimizer's tensors in the background
        (class docstring); ``last_staging`` says what was copied how, and why anything was copied eagerly.
        """
        check_step(step)
        self.wait()
        started = time.perf_counter()
        storage = open_storage(path, self.storage_options)
        named: list[NamedTensor] = []
        trees: dict[str, Any] = {"progress": {"step": step, **(progress or {})}}
        ident = None
        if adapter_only:
            if model is None:
                raise CkptError("adapter_only=True needs model= (its trainable parameters are the adapter)")
            named.extend(model_tensors(adapters.trainable(model)))
            ident = self._base.identity(model, base_source)
        elif model is not None:
            named.extend(model_tensors(model))
        if optimizer is not None:
            opt_tensors, trees["optimizer"] = self.capture_optimizer(optimizer, model)
            named.extend(opt_tensors)
        if scheduler is not None:
            trees["scheduler"] = treecodec.encode(state_dict_of(scheduler, "scheduler"), "scheduler")
        if scaler is not None:
            trees["scaler"] = treecodec.encode(state_dict_of(scaler, "scaler"), "scaler")
        if tokenizer is not None:
            trees["tokenizer"] = tokenizer_mod.identity(tokenizer)
        if metadata is not None:
            trees["user"] = treecodec.encode(metadata, "metadata")
        if extra:
            trees["extra"] = extra
        rank_trees: dict[str, Any] = {}
        if rng:
            rank_trees["rng"] = rng_mod.capture()
        if dataloader is not None:
            rank_trees["data"] = treecodec.encode(_loader_state(dataloader), "dataloader")
            rank_trees["data_position"] = data_mod.position_of(dataloader)

        refused: CkptError | None = None
        try:
            self.check_state(named)
            pieces, local, groups = self._describe(named)
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
        if adapter_only:
            trees["adapter"] = adapters.manifest_record(
                self.coll.all_gather(ident), adapters.lora_config(model)
            )
        if info["exists"] and not overwrite:
            raise CheckpointExistsError(
                f"{storage.display(MANIFEST_NAME)} already exists: step {step} is committed (pass overwrite=True)"
            )
        write = self._assign(pieces, groups)
        check = verify_replicas if verify_replicas is not None else self.verify_replicas
        if (check or not self._replicas_checked) and self.coll.world_size > 1:
            if self.last_plan == "exact":
                assert self._per_rank is not None
                check_replicas(self.coll, replicated_keys(self._per_rank), local)
            else:  # the local plan's groups say which pieces have replicas, and with whom
                held = [(p, g) for p, g in zip(pieces, groups, strict=True) if g is not None and g.size > 1]
                check_replica_groups(self.coll, held, local)
            self._replicas_checked = True
        if info["exists"] and self.coll.rank == 0:
            storage.delete(MANIFEST_NAME)
        mine = [(p, local[(p.name, p.box)]) for p, w in zip(pieces, write, strict=True) if w]
        order = {p.name: i for i, p in enumerate(pieces)}
        descs = [(order[d.name], d) for d in {p.name: p.desc for p, _ in mine}.values()]
        chunks: list[tuple[str, Box, torch.Tensor]] = []
        for p, t in mine:
            for b in chunk_boxes(p.box, p.itemsize, self.chunk_bytes):
                sub = t[b.relative_to(p.box)[0]] if b != p.box else t
                chunks.append((p.name, b, sub))
        backend = detect_backend([t for _, _, t in chunks] or [n.tensor for n in named])
        staged: Staged | None = None
        if self.async_save or backend != "cpu":
            want = self.async_save and (self.lazy if lazy is None else lazy)
            staged = self._stage([t for _, _, t in chunks], backend, want, optimizer, model)
            host = staged.hosts
        else:
            host = [t.detach().contiguous() for _, _, t in chunks]
        chunks = [(n, b, h) for (n, b, _), h in zip(chunks, host, strict=True)]
        world = self.coll.world_size
        job = _Job(
            storage=storage,
            step=step,
            chunks=chunks,
            codec=self.codec,
            descs=descs,
            trees=trees,
            rank_trees=rank_trees,
            layout=layout or default_layout(named, world),
            backend=backend,
            attempt=info["attempt"],
            started=started,
            blocking_s=0.0,
            on_commit=on_commit,
            rng_seed=rng_seed,
            written=[(p.name, p.box) for p, _ in mine],
            staged=staged,
        )
        fut: Future = Future()
        job.blocking_s = time.perf_counter() - started
        if not self.async_save:
            fut.set_result(self._run(job))
            return fut
        self._inflight = fut
        self._thread = threading.Thread(
            target=self._background, args=(job, fut), name="ckpt-writer", daemon=True
        )
        self._thread.start()
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
            for handles in self._hooked.values():
                for h in handles:
                    h.remove()
            self._hooked.clear()
            for _, h in self._hooked_strong.values():
                h.remove()
            self._hooked_strong.clear()

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

    # ------------------------------------------------------------------------------------------------ internals
    def _stage(
        self, tensors: list[torch.Tensor], backend: str, lazy: bool, optimizer: Any, model: Any
    ) -> Staged:
        """Start the host copy of ``tensors``: in the background for those the optimizer owns when ``lazy`` and a
        step hook can guard them, before returning for the rest (the reason lands in ``last_staging``)."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        begin = getattr(self.stager, "begin", None)
        flags = [False] * len(tensors)
        reason: str | None = None
        if not lazy:
            reason = "lazy staging off (lazy=False or a synchronous save)"
        elif begin is None:
            reason = f"{type(self.stager).__name__} copies eagerly (it has no background begin())"
        elif backend == "neuron":
            reason = (
                "XLA tensors: a held alias follows later in-place edits, so they are copied before returning"
            )
        elif optimizer is None:
            reason = "no optimizer= given: no step hook can guard the saved tensors"
        elif not callable(getattr(optimizer, "register_step_pre_hook", None)):
            reason = f"optimizer {type(optimizer).__name__} has no register_step_pre_hook"
        elif not getattr(type(optimizer).step, "hooked", False):
            # torch.optim.Optimizer.__init__ wraps the class's step() so that it runs the hooks; a wrapper that
            # never called it would accept a hook and never run it
            reason = f"{type(optimizer).__name__}.step() does not run step hooks (Optimizer.__init__ was not called)"
        else:
            owned = _owned_storages(optimizer)
            flags = [_storage_key(t) in owned for t in tensors]
            rest = sum(s for s, f in zip(sizes, flags, strict=True) if not f)
            if rest:
                n = flags.count(False)
                reason = f"{count(n, 'tensor')}, {rest} bytes, not owned by the optimizer (buffers, frozen weights)"
        if begin is None:
            staged = Staged(self.stager.stage(tensors))
        else:
            staged = begin(tensors, flags)
        lazy_bytes = sum(s for s, f in zip(sizes, flags, strict=True) if f)
        self.last_staging = StagingInfo(lazy_bytes, sum(sizes) - lazy_bytes, reason)
        if any(flags):
            self._install_hooks(optimizer, model)
            self._staged = staged
        return staged

    def _install_hooks(self, optimizer: Any, model: Any) -> None:
        """Step pre-hook on the optimizer (and a load_state_dict pre-hook on the model): both call staged()."""
        ref = weakref.ref(self)

        def guard(*_: Any, **__: Any) -> None:
            me = ref()
            if me is not None:
                me.staged()

        for obj, register in (
            (optimizer, "register_step_pre_hook"),
            (model, "register_load_state_dict_pre_hook"),
        ):
            fn = getattr(obj, register, None)
            if fn is None:
                continue
            try:
                if obj not in self._hooked:
                    self._hooked[obj] = [fn(guard)]
            except TypeError:  # not weak-referenceable: held (strongly) until close()
                if id(obj) not in self._hooked_strong:
                    self._hooked_strong[id(obj)] = (obj, fn(guard))

    def _assign(self, pieces: list[HeldBox], groups: list[Group | None]) -> list[bool]:
        """Which of this rank's pieces it writes (module docstring, step 2).  Collective."""
        if not self.coll.active:
            self.last_plan = "local"
            return [True] * len(pieces)
        known = all(g is not None for g in groups)
        write, (a, b) = plan_local(pieces, groups) if known else ([], (0, 0))  # type: ignore[arg-type]
        a_tot, b_tot, unknown = self.coll.all_reduce_sum([a, b, 0 if known else 1])
        if not unknown and plan_check((a_tot, b_tot)):
            self.last_plan = "local"
            return write
        self.last_plan = "exact"
        key = self.coll.all_gather(digest(pieces))
        if key != self._plan_key or self._plan is None:
            self._per_rank = self.coll.all_gather(pieces)
            self._plan = assign_writers(self._per_rank)
            self._plan_key = key
        return [self._plan[(p.name, p.box)] == self.coll.rank for p in pieces]

    def _describe(
        self, named: list[NamedTensor]
    ) -> tuple[list[HeldBox], dict[tuple[str, Box], torch.Tensor], list[Group | None]]:
        """This rank's pieces, their local tensors, and the replica group of each where it can be derived."""
        from torch.distributed.tensor import DTensor

        pieces: list[HeldBox] = []
        local: dict[tuple[str, Box], torch.Tensor] = {}
        groups: list[Group | None] = []
        seen: set[str] = set()
        group_of = getattr(self.layout_hook, "replica_group", None)
        for nt in named:
            if nt.name in seen:
                raise CkptError(f"tensor name {nt.name!r} appears twice in the saved state")
            seen.add(nt.name)
            hooked = self.layout_hook(nt) if self.layout_hook is not None else None
            if hooked is not None:
                shape, box, t, partition = hooked
            else:
                shape, box, t = local_box(nt.tensor)
                partition = None
            group: Group | None
            if group_of is not None:  # the layout hook knows the parallel state
                group = group_of(nt, partition)
            elif isinstance(nt.tensor, DTensor):
                group = dtensor_group(nt.tensor)
            elif hooked is None:
                group = world_group(self.coll.rank, self.coll.world_size)
            else:
                group = None
            p = HeldBox(
                TensorDesc(nt.name, nt.role, shape, dtype_name(t.dtype), nt.param, nt.key, partition), box
            )
            pieces.append(p)
            local[(p.name, p.box)] = t
            groups.append(group)
        return pieces, local, groups

    def _background(self, job: _Job, fut: Future) -> None:
        try:
            fut.set_result(self._run(job))
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(e)

    def _run(self, job: _Job) -> SaveResult:
        rank = self.coll.rank
        v2 = (self.format_version or DEFAULT_FORMAT_VERSION) == 2
        receipt = Receipt(rank)
        report: dict[str, Any] = {"ok": True, "rank": rank, "descs": job.descs}
        try:
            if job.staged is not None:
                job.staged.wait()  # lazy copies land in the arena before the writer reads it
            if job.chunks:
                write_data_file(
                    job.storage,
                    receipt,
                    data_file_name(rank, job.attempt),
                    job.chunks,
                    job.codec,
                    {"step": str(job.step), "rank": str(rank)},
                )
            if v2:  # this rank's own index and state file; rank 0 gets their checksums and its boxes
                # a tensor is described by the writer of its first element only (T descriptions in all, not N x T;
                # the ranks agreed on every description in planning: plan_check / assign_writers)
                origin = {n for n, b in job.written or () if not any(b.offsets)}
                report["descs"] = [(pos, d) for pos, d in job.descs if d.name in origin]
                rng = job.rank_trees.get("rng")
                report["summary"] = write_rank_files(
                    job.storage, receipt, job.attempt, job.written or [], rng, job.rank_trees.get("data")
                )
                report["rng_digests"] = rng_rule.stream_digests(rng) if rng is not None else None
                report["has_data"] = "data" in job.rank_trees
                report["data_position"] = job.rank_trees.get("data_position")
                if rank == 0:
                    report["rng"] = rng
            else:
                report.update(trees=job.rank_trees, receipt=receipt)
        except Exception as e:  # noqa: BLE001 - reported to rank 0 so that it does not commit
            report = {"ok": False, "rank": rank, "error": f"rank {rank}: {type(e).__name__}: {e}"}
        reports = self.coll.gather(report)
        outcome: dict[str, Any] = {"ok": True}
        if rank == 0:
            assert reports is not None
            failed = [r["error"] for r in reports if not r["ok"]]
            if failed:
                outcome = {"ok": False, "error": "; ".join(failed)}
            else:
                try:
                    if v2:
                        top, nbytes = self._top_v2(job, reports)
                        job.storage.put_bytes(MANIFEST_NAME, top.encode(), exclusive=True)
                    else:
                        manifest = self._manifest(job, reports)
                        publish(job.storage, manifest, 1)
                        nbytes = manifest.total_bytes
                    outcome = {"ok": True, "bytes": nbytes}
                except Exception as e:  # noqa: BLE001
                    outcome = {"ok": False, "error": f"rank 0 commit: {type(e).__name__}: {e}"}
        outcome = self.coll.broadcast(outcome)
        if not outcome["ok"]:
            raise AsyncSaveError(
                f"save of step {job.step} to {job.storage.display()} failed, not committed: {outcome['error']}"
            )
        result = SaveResult(
            job.step,
            job.storage.display(),
            job.blocking_s,
            time.perf_counter() - job.started,
            outcome.get("bytes", 0),
        )
        if rank == 0 and job.on_commit is not None:
            try:
                job.on_commit(result)
            except Exception as e:  # noqa: BLE001 - the checkpoint is committed; housekeeping must not undo that
                warnings.warn(f"after committing step {job.step}: {type(e).__name__}: {e}", stacklevel=1)
        return result

    @staticmethod
    def _metas(reports: list[dict[str, Any]]) -> list[TensorDesc]:
        """Every written tensor's description, in the order the ranks hold them (position in the writer's state,
        then rank): the model's order for DDP/FSDP/HSDP/TP, where every rank holds the same names in one order."""
        metas: dict[str, tuple[tuple[int, int], TensorDesc]] = {}
        for r in reports:
            for pos, d in r["descs"]:
                seen = metas.get(d.name)
                if seen is None or (pos, r["rank"]) < seen[0]:
                    metas[d.name] = ((pos, r["rank"]), d)
                if seen is not None and seen[1] != d:
                    raise StateMismatchError(
                        f"tensor {d.name!r}: rank {r['rank']} has shape {list(d.shape)} {d.dtype}, rank "
                        f"{seen[0][1]} has {list(seen[1].shape)} {seen[1].dtype}"
                    )
        return [d for _, d in sorted(metas.values(), key=lambda v: v[0])]

    def _manifest(self, job: _Job, reports: list[dict[str, Any]]) -> Manifest:
        """Format v1: the whole manifest from every rank's receipt and trees."""
        receipts = [r["receipt"] for r in reports]
        trees = dict(job.trees)
        by_rank = sorted(reports, key=lambda r: r["rank"])
        if any("data" in r["trees"] for r in by_rank):
            trees["data_position"] = data_mod.merge_json(
                [r["trees"].get("data_position") for r in by_rank], trees.get("progress", {})
            )
        rng_records = {str(r["rank"]): r["trees"]["rng"] for r in by_rank if "rng" in r["trees"]}
        trees["rng_base"] = rng_rule.base_record(rng_records, job.rng_seed)
        return build_manifest(
            step=job.step,
            backend=job.backend,
            layout=job.layout,
            metas=self._metas(reports),
            receipts=receipts,
            trees=trees,
            rank_trees={r["receipt"].rank: r["trees"] for r in reports},
        )

    def _top_v2(self, job: _Job, reports: list[dict[str, Any]]) -> tuple[str, int]:
        """Format v2: the top manifest from every rank's summary (ckpt.format.seal), and the bytes of data."""
        trees = dict(job.trees)
        by_rank = sorted(reports, key=lambda r: r["rank"])
        if any(r["has_data"] for r in by_rank):
            trees["data_position"] = data_mod.merge_json(
                [r["data_position"] for r in by_rank], trees.get("progress", {})
            )
        digests = [r["rng_digests"] for r in by_rank if r["rng_digests"] is not None]
        if digests:
            first = next(r for r in by_rank if r["rng_digests"] is not None)
            if (
                first["rank"] != 0
            ):  # only rank 0 sends its whole record; the lowest rank holding one is 0 in practice
                raise CkptError(f"rank 0 saved no RNG state but rank {first['rank']} did")
            trees["rng_base"] = rng_rule.base_record_of(first["rng"], digests, job.rng_seed)
        return build_top(
            step=job.step,
            backend=job.backend,
            layout=job.layout,
            metas=self._metas(reports),
            summaries=[r["summary"] for r in by_rank],
            trees=trees,
        )


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    return (str(t.device), t.untyped_storage().data_ptr())


def _owned_storages(optimizer: Any) -> set[tuple[str, int]]:
    """Storages that only ``optimizer.step()`` mutates in a training loop: its parameters and its state tensors."""
    owned: set[tuple[str, int]] = set()
    # ZeRO-1 wrappers keep the sharded master weights and moments in their base optimizer, which their own step()
    # (the hooked call) steps
    for opt in (optimizer, getattr(optimizer, "base_optimizer", None)):
        if opt is None:
            continue
        for g in getattr(opt, "param_groups", []):
            for p in g["params"]:
                owned.add(_storage_key(p))
        for per_param in getattr(opt, "state", {}).values():
            for v in per_param.values():
                if isinstance(v, torch.Tensor):
                    owned.add(_storage_key(v))
    return {k for k in owned if k[1] != 0}


def _loader_state(loader: Any) -> Any:
    """A loader's ``state_dict``; a plain DataLoader has none, and the fix is one call (ckpt.data.track)."""
    from torch.utils.data import DataLoader

    if isinstance(loader, DataLoader) and not hasattr(loader, "state_dict"):
        raise StateMismatchError(
            "dataloader= is a plain torch DataLoader, which keeps no position: wrap it with "
            "ckpt.data.track(loader) and iterate the wrapper, or use torchdata's StatefulDataLoader"
        )
    from ..data.adapters import adapter_for, describe
    from ..data.tracked import TrackedLoader

    if isinstance(loader, TrackedLoader) and adapter_for(loader) is None:
        # A tracked loader keeps only a batch count; its position is restored through the sampler, which only an
        # adapter knows how to reposition: restoring this one would restart the epoch in a new order.
        raise StateMismatchError(
            f"dataloader= is ckpt.data.track over a loader no data adapter can reposition ({describe(loader)}): "
            "a restore would restart its epoch in a new order; use torchdata's StatefulDataLoader (it saves its "
            "RandomSampler's state) or sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=S)"
        )
    return state_dict_of(loader, "dataloader")


def _agree(mine: CkptError | None, errors: list[str | None]) -> None:
    """Every rank raises when any rank refused: its own error, else the first refusing rank's."""
    if mine is not None:
        raise mine
    for rank, err in enumerate(errors):
        if err is not None:
            raise CkptError(f"rank {rank} refused the save, nothing written: {err}")


def default_layout(named: list[NamedTensor], world: int) -> Layout:
    """Data-parallel over all ranks; for DTensor state, the device mesh it is sharded over."""
    from torch.distributed.tensor import DTensor

    for n in named:
        if isinstance(n.tensor, DTensor):
            mesh = n.tensor.device_mesh
            return Layout(
                world_size=world,
                dp=world,
                mesh={"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or [])},
                kind="dtensor",
            )
    return Layout(world_size=world, dp=world, kind="replicated")
