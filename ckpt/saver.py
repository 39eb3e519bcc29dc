"""Sharded, synchronous or asynchronous saving on every rank, with the manifest written last by rank 0.

Call order (every rank calls :meth:`Checkpointer.save` with the same path and step):

1. capture: flatten model / optimizer into named tensors and the rest into JSON trees (cheap);
2. plan (collective, cached): all ranks exchange a digest of what they hold; when it changed since the last
   save they exchange the descriptions and each computes the same writer assignment (planning.assign_writers);
3. stage (async only): copy this rank's assigned tensors to host memory.  ``save`` returns here;
4. write (background thread when async): one safetensors data file per rank under the checkpoint prefix;
5. commit (collective): ranks send rank 0 their receipts (file sizes, shard offsets, checksums) or their error;
   rank 0 writes ``manifest.json`` create-only iff every rank succeeded, then tells every rank the outcome.

A failure anywhere means no manifest, hence no checkpoint; an async failure is raised at the next
``save``/``wait``/``close``.
"""

from __future__ import annotations

import threading
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from . import adapters, rng_rule, treecodec
from . import data as data_mod
from . import rng as rng_mod
from . import tokenizer as tokenizer_mod
from .commit import Receipt, build_manifest, data_file_name, publish, write_data_file
from .distributed import Collective
from .dtypes import dtype_name
from .errors import AsyncSaveError, CheckpointExistsError, CkptError, StateMismatchError
from .manifest import MANIFEST_NAME, Box, Layout, Manifest, TensorDesc
from .planning import DEFAULT_CHUNK_BYTES, Piece, assign_writers, chunk_boxes, digest, local_box
from .replicas import check_replicas
from .staging import HostStager
from .state import NamedTensor, model_tensors, optimizer_capture, state_dict_of
from .storage import Storage, open_storage

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


@dataclass
class _Job:
    storage: Storage
    step: int
    chunks: list[tuple[str, Box, torch.Tensor]]
    codec: str
    per_rank: list[list[Piece]] | None
    trees: dict[str, Any]
    rank_trees: dict[str, Any]
    layout: Layout
    backend: str
    attempt: str
    started: float
    blocking_s: float
    on_commit: Callable[[SaveResult], None] | None = None
    rng_seed: int | None = None


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

    ``async_save=True`` returns from :meth:`save` once tensors are staged in host memory; one save is in flight
    at a time; ``close()`` waits for it.

    Replicated state (a box of a tensor that several ranks hold: DDP replicas, TP-replicated norms) is written by one
    rank only, so its copies are compared first (:func:`ckpt.replicas.check_replicas`, xxh3 digests all-gathered):
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
    ) -> None:
        self.async_save = async_save
        self.verify_replicas = verify_replicas
        self._replicas_checked = False
        self.coll = Collective(process_group)
        self.chunk_bytes = chunk_bytes
        self.codec = codec
        self.storage_options = storage_options
        self.layout_hook = layout_hook
        self.stager = stager or HostStager()
        self._plan_key: list[str] | None = None
        self._plan: dict[tuple[str, Box], int] | None = None
        self._per_rank: list[list[Piece]] | None = None
        self._inflight: Future | None = None
        self._thread: threading.Thread | None = None
        self._base = adapters.BaseTracker()

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
        (:mod:`ckpt.adapters`; ``base_source`` says where the base was loaded from, default: its config's
        ``_name_or_path``).  Save the base itself once with a plain save when it is not on storage already.
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
            pieces, local = self._describe(named)
        except CkptError as e:
            if not self.coll.active:
                raise
            refused, pieces, local = e, [], {}
        rank0 = (
            {"attempt": uuid.uuid4().hex[:8], "exists": storage.exists(MANIFEST_NAME)}
            if self.coll.rank == 0 and refused is None
            else None
        )
        gathered = self.coll.all_gather(
            (digest(pieces), rank0, None if refused is None else str(refused), ident)
        )
        _agree(refused, [g[2] for g in gathered])
        info = gathered[0][1]
        if adapter_only:
            trees["adapter"] = adapters.manifest_record([g[3] for g in gathered], adapters.lora_config(model))
        if info["exists"] and not overwrite:
            raise CheckpointExistsError(
                f"{storage.display(MANIFEST_NAME)} already exists: step {step} is committed (pass overwrite=True)"
            )
        key = [g[0] for g in gathered]
        if key != self._plan_key:
            self._per_rank = self.coll.all_gather(pieces)
            self._plan = assign_writers(self._per_rank)
            self._plan_key = key
        check = verify_replicas if verify_replicas is not None else self.verify_replicas
        if (check or not self._replicas_checked) and self.coll.world_size > 1:
            check_replicas(self.coll, self._per_rank, local)
            self._replicas_checked = True
        if info["exists"] and self.coll.rank == 0:
            storage.delete(MANIFEST_NAME)
        assert self._plan is not None
        mine = [(p, local[(p.name, p.box)]) for p in pieces if self._plan[(p.name, p.box)] == self.coll.rank]
        chunks: list[tuple[str, Box, torch.Tensor]] = []
        for p, t in mine:
            for b in chunk_boxes(p.box, p.itemsize, self.chunk_bytes):
                sub = t[b.relative_to(p.box)[0]] if b != p.box else t
                chunks.append((p.name, b, sub))
        backend = detect_backend([t for _, _, t in chunks] or [n.tensor for n in named])
        if self.async_save or backend != "cpu":
            host = self.stager.stage([t for _, _, t in chunks])
        else:
            host = [t.detach().contiguous() for _, _, t in chunks]
        chunks = [(n, b, h) for (n, b, _), h in zip(chunks, host, strict=True)]
        world = self.coll.world_size
        job = _Job(
            storage=storage,
            step=step,
            chunks=chunks,
            codec=self.codec,
            per_rank=self._per_rank if self.coll.rank == 0 else None,
            trees=trees,
            rank_trees=rank_trees,
            layout=layout or default_layout(named, world),
            backend=backend,
            attempt=info["attempt"],
            started=started,
            blocking_s=0.0,
            on_commit=on_commit,
            rng_seed=rng_seed,
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

    def check_state(self, named: list[NamedTensor]) -> None:
        """Refuse state this checkpointer cannot describe without guessing (an extension point; raises CkptError).
        Called on every rank before anything is exchanged; a refusal on any rank fails the save on every rank."""

    def capture_optimizer(self, optimizer: Any, model: Any) -> tuple[list[NamedTensor], dict[str, Any]]:
        """Named tensors and JSON tree of ``optimizer``.  An extension point: optimizers whose ``state_dict`` is
        not torch.optim's (ZeRO-1 wrappers keep sharded ``base_state``) override it in a subclass."""
        return optimizer_capture(optimizer, model)

    # ------------------------------------------------------------------------------------------------ internals
    def _describe(self, named: list[NamedTensor]) -> tuple[list[Piece], dict[tuple[str, Box], torch.Tensor]]:
        pieces: list[Piece] = []
        local: dict[tuple[str, Box], torch.Tensor] = {}
        seen: set[str] = set()
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
            p = Piece(
                TensorDesc(nt.name, nt.role, shape, dtype_name(t.dtype), nt.param, nt.key, partition), box
            )
            pieces.append(p)
            local[(p.name, p.box)] = t
        return pieces, local

    def _background(self, job: _Job, fut: Future) -> None:
        try:
            fut.set_result(self._run(job))
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(e)

    def _run(self, job: _Job) -> SaveResult:
        rank = self.coll.rank
        receipt = Receipt(rank)
        report: dict[str, Any] = {"ok": True, "rank": rank, "trees": job.rank_trees, "receipt": receipt}
        try:
            if job.chunks:
                write_data_file(
                    job.storage,
                    receipt,
                    data_file_name(rank, job.attempt),
                    job.chunks,
                    job.codec,
                    {"step": str(job.step), "rank": str(rank)},
                )
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
                    manifest = self._manifest(job, reports)
                    publish(job.storage, manifest)
                    outcome = {"ok": True, "bytes": manifest.total_bytes}
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

    def _manifest(self, job: _Job, reports: list[dict[str, Any]]) -> Manifest:
        assert job.per_rank is not None
        metas: dict[str, TensorDesc] = {}
        for pieces in job.per_rank:
            for p in pieces:
                metas.setdefault(p.name, p.desc)
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
            metas=metas.values(),
            receipts=receipts,
            trees=trees,
            rank_trees={r["receipt"].rank: r["trees"] for r in reports},
        )


def _loader_state(loader: Any) -> Any:
    """A loader's ``state_dict``; a plain DataLoader has none, and the fix is one call (ckpt.data.track)."""
    from torch.utils.data import DataLoader

    if isinstance(loader, DataLoader) and not hasattr(loader, "state_dict"):
        raise StateMismatchError(
            "dataloader= is a plain torch DataLoader, which keeps no position: wrap it with "
            "ckpt.data.track(loader) and iterate the wrapper, or use torchdata's StatefulDataLoader"
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
