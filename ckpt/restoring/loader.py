"""Restoring training state in place, on any number of ranks (resharding by box overlap).

Each rank computes which box of every global tensor it holds now (plain tensor: all of it; DTensor: its local
shard) and reads only the stored shards overlapping that box.  Optimizer state is matched to parameters by name
and follows its parameter's current sharding, so a checkpoint saved on W ranks restores on W' ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import StateMismatchError
from ..format import treecodec
from ..format.dtypes import dtype_from_name
from ..format.manifest import Box, Manifest
from ..format.reader import CheckpointReader
from ..state import rng as rng_mod
from ..state.training import (
    NamedTensor,
    load_state_into,
    local_box,
    model_tensors,
    optim_name,
    param_names_in_optimizer_order,
)
from .upload import PinnedUploader

MODEL_ROLES = ("parameter", "buffer")


@dataclass(frozen=True)
class RestoreResult:
    step: int
    path: str
    manifest: Manifest
    progress: dict[str, Any]
    metadata: Any
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    rng_restored: list[str] = field(default_factory=list)
    #: RNG streams restored from the checkpoint as saved (own rank's, or a stream shared by every saving rank)
    rng_carried: list[str] = field(default_factory=list)
    #: RNG streams re-seeded from the base seed, step and rank (the DP size changed and the stream was per-rank)
    rng_derived: list[str] = field(default_factory=list)
    #: how the data loader was placed (ckpt.data.DataRestore), None when no dataloader= was given
    data: Any = None
    #: where CheckpointManager found this rank's state: "local", "peer" (a replica on another node) or
    #: "persistent" (ckpt.tiers); None for a plain ckpt.restore
    tier: str | None = None


def _names_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Restorer:
    """Fills live objects from a :class:`CheckpointReader`."""

    def __init__(self, reader: CheckpointReader, layout_hook: Any = None) -> None:
        self.reader = reader
        self.layout_hook = layout_hook
        self._uploader: PinnedUploader | None = None  # CUDA targets: pinned buffer, batched async copies

    def _upload(self, name: str, box: Box, dst: torch.Tensor) -> bool:
        """Fill the CUDA tensor ``dst`` (this rank's ``box`` of ``name``) through the pinned uploader; False when
        it does not apply (not CUDA, or the stored dtype differs and needs a cast on the host)."""
        if not dst.is_cuda or dst.dtype != dtype_from_name(self.reader.entry(name).dtype):
            return False
        if self._uploader is None:
            self._uploader = PinnedUploader()
        self._uploader.fill(dst, lambda host: self.reader.read_box_into(name, box, host))
        return True

    def finish(self) -> None:
        """Wait for queued host-to-device copies (restore() calls it last) and free the pinned buffer."""
        if self._uploader is not None:
            self._uploader.finish()
            self._uploader = None

    def fill(self, nt: NamedTensor, entry_name: str) -> None:
        """Copy the checkpoint's values for this rank's part of ``nt`` into ``nt.tensor`` in place."""
        e = self.reader.entry(entry_name)
        hooked = self.layout_hook(nt) if self.layout_hook is not None else None
        shape, box, local = hooked[:3] if hooked is not None else local_box(nt.tensor)
        if tuple(shape) != e.shape:
            raise StateMismatchError(
                f"tensor {entry_name!r}: checkpoint has shape {list(e.shape)}, the live tensor is {list(shape)}"
            )
        self.read_into(entry_name, box, local)

    def read_into(self, name: str, box: Box, local: torch.Tensor) -> None:
        e = self.reader.entry(name)
        if local.device.type == "cpu" and local.is_contiguous() and local.dtype == dtype_from_name(e.dtype):
            # filled when the enclosing reader.deferred() block ends (with every other tensor, in parallel)
            self.reader.read_box_into(name, box, local.detach(), defer=True)
            return
        if self._upload(name, box, local.detach()):
            return
        tmp = torch.empty(box.lengths, dtype=dtype_from_name(e.dtype))
        self.reader.read_box_into(name, box, tmp)
        with torch.no_grad():
            local.copy_(tmp)

    # ------------------------------------------------------------------------------------------------ model
    def model(self, model: Any, strict: bool) -> tuple[list[str], list[str]]:
        m = self.reader.manifest
        targets = model_tensors(model)
        saved = {n for n, t in m.tensors.items() if t.role in MODEL_ROLES}
        live = {nt.name for nt in targets}
        missing = sorted(live - saved)
        unexpected = sorted(saved - live)
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append(f"missing from checkpoint: {_names_list(missing)}")
            if unexpected:
                parts.append(f"not in the model: {_names_list(unexpected)}")
            raise StateMismatchError(
                f"{self.reader.path}: model does not match the checkpoint: {'; '.join(parts)}"
            )
        with self.reader.deferred():
            for nt in targets:
                if nt.name in saved:
                    self.fill(nt, nt.name)
        return missing, unexpected

    # ------------------------------------------------------------------------------------------------ optimizer
    def optimizer(self, optimizer: torch.optim.Optimizer, model: Any) -> None:
        m = self.reader.manifest
        meta = m.optimizer
        if meta is None:
            raise StateMismatchError(f"{self.reader.path}: checkpoint holds no optimizer state")
        names = param_names_in_optimizer_order(optimizer, model)
        params = dict(model.named_parameters(remove_duplicate=False))
        saved_groups = meta["param_groups"]
        if len(saved_groups) != len(optimizer.param_groups):
            raise StateMismatchError(
                f"{self.reader.path}: checkpoint optimizer has {len(saved_groups)} param_groups, the live one "
                f"has {len(optimizer.param_groups)}"
            )
        groups = []
        index = 0
        held = self.held_params()
        for gi, (saved, live) in enumerate(zip(saved_groups, optimizer.param_groups, strict=True)):
            live_names = names[index : index + len(live["params"])]
            saved_names = [n for n in saved["params"] if held is None or n in held]
            if set(saved_names) != set(live_names):
                diff = sorted(set(saved_names) ^ set(live_names))
                raise StateMismatchError(
                    f"{self.reader.path}: param_groups[{gi}] holds different parameters than the live optimizer: "
                    f"{_names_list(diff)}"
                )
            g = {k: treecodec.decode(v) for k, v in saved.items() if k != "params"}
            g["params"] = list(range(index, index + len(live_names)))
            groups.append(g)
            index += len(live_names)
        by_param: dict[str, dict[str, str]] = {}
        for n, t in m.tensors.items():
            if t.role == "optimizer_state" and t.param is not None and t.key is not None:
                by_param.setdefault(t.param, {})[t.key] = n
        scalars = meta.get("state", {})
        state: dict[int, dict[str, Any]] = {}
        with self.reader.deferred():
            for i, pname in enumerate(names):
                per: dict[str, Any] = {k: treecodec.decode(v) for k, v in scalars.get(pname, {}).items()}
                for key, ename in by_param.get(pname, {}).items():
                    per[key] = self._optimizer_tensor(ename, params[pname])
                if per:
                    state[i] = per
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    def held_params(self) -> set[str] | None:
        """Names of the saved parameters this rank's optimizer holds a share of; None: all of them.  A pipeline
        stage holds only its stage's (:class:`ckpt.neuron.NeuronRestorer`), while the checkpoint's optimizer record
        lists every stage's parameters."""
        return None

    def _optimizer_tensor(self, ename: str, param: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        e = self.reader.entry(ename)
        dtype = dtype_from_name(e.dtype)
        if tuple(param.shape) == e.shape:
            shape, box, local = local_box(param)
            if local.is_cuda and torch.cuda.is_available():
                buf = torch.empty(box.lengths, dtype=dtype, device=local.device)
                self._upload(ename, box, buf)
            else:
                buf = torch.empty(box.lengths, dtype=dtype)
                # on the CPU ``buf`` itself becomes the state (``.to`` and ``from_local`` do not copy): it may be
                # filled when the optimizer's deferred() block ends
                self.reader.read_box_into(ename, box, buf, defer=local.device.type == "cpu")
            if isinstance(param, DTensor):
                return DTensor.from_local(
                    buf.to(local.device),
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
            return buf.to(param.device)
        return self.reader.read(ename).to(param.device)


def restore(
    path: str | CheckpointReader,
    *,
    model: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    dataloader: Any = None,
    rng: bool = True,
    strict: bool = True,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    layout_hook: Any = None,
    restorer: Any = None,
    check_base: bool = True,
) -> RestoreResult:
    """Restore everything given, in place, from the checkpoint at ``path``. Call on every rank.

    Model and optimizer are restored for this rank's current sharding.  On the DP size the checkpoint was saved
    with, RNG and data-loader state are this rank's own; on another, the data loader continues the global data
    position (ckpt.data: loaders an adapter knows, others are refused) and RNG streams follow ckpt.state.rng's rule
    (shared streams carried, per-rank ones re-derived); ``RestoreResult`` says which.  ``strict`` (default)
    refuses missing/unexpected names and a loader that cannot be re-split.  ``restorer`` (a ``Restorer`` subclass or factory taking ``(reader, layout_hook)``) lets a
    backend change how tensors reach their device or how a non-torch.optim optimizer is filled.

    An adapter-only checkpoint (``manifest.adapter``) restores the model's trainable parameters only, after checking
    (``check_base``) that the frozen base in ``model`` is the one the adapter was trained on.
    """
    reader = (
        path
        if isinstance(path, CheckpointReader)
        else CheckpointReader(path, storage_options, verify, lazy=True)
    )
    m = reader.manifest
    if reader.locator is not None:  # format v2 read lazily: each rank's trees come from its index when asked
        m = dataclasses.replace(m, rng=reader.locator.trees("rng"), data=reader.locator.trees("data"))
    r = (restorer or Restorer)(reader, layout_hook)
    missing: list[str] = []
    unexpected: list[str] = []
    if model is not None and m.adapter is not None:
        from ..state import adapters

        if check_base:
            rank, world = _rank()
            adapters.check_base(m.adapter, adapters.base_identity(model), rank, world, reader.path)
        missing, unexpected = r.model(adapters.trainable(model), strict)
    elif model is not None:
        missing, unexpected = r.model(model, strict)
    if optimizer is not None:
        r.optimizer(optimizer, model)
    finish = getattr(r, "finish", None)
    if finish is not None:
        finish()
    if scheduler is not None:
        if m.scheduler is None:
            raise StateMismatchError(f"{reader.path}: checkpoint holds no scheduler state")
        load_state_into(scheduler, treecodec.decode(m.scheduler), "scheduler")
    if scaler is not None:
        if m.scaler is None:
            raise StateMismatchError(f"{reader.path}: checkpoint holds no GradScaler state")
        load_state_into(scaler, treecodec.decode(m.scaler), "scaler")
    rank, world = _rank()
    data_outcome = None
    if dataloader is not None:
        from ..data import restore as restore_data

        data_outcome = restore_data(dataloader, m, rank, world, reader.path, strict)
    carried: list[str] = []
    derived: list[str] = []
    if rng and m.rng:
        carried, derived = rng_mod.restore_across(m.rng, m.rng_base, m.step, rank, world)
    return RestoreResult(
        step=m.step,
        path=reader.path,
        manifest=m,
        progress=dict(m.progress),
        metadata=treecodec.decode(m.user) if m.user is not None else None,
        missing=missing,
        unexpected=unexpected,
        rng_restored=carried + derived,
        rng_carried=carried,
        rng_derived=derived,
        data=data_outcome,
    )


__all__ = ["RestoreResult", "restore", "optim_name"]
