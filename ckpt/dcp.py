"""``torch.distributed.checkpoint`` reads ckpt checkpoints directly: :class:`Reader`, a DCP ``StorageReader``.

Why: torchtitan and other DCP users restore with ``dcp.load(state_dict, storage_reader=...)`` into whatever
sharding the job has now (FSDP2 DTensors, TP, a single process).  Giving DCP a reader over our manifest lets
them load a ckpt checkpoint with no conversion step; DCP's own planner computes which part of which stored
chunk each rank needs, and this reader only answers "what is stored" and "read this box".

Usage (every rank)::

    import torch.distributed.checkpoint as dcp
    from ckpt.dcp import Reader

    sd = model.state_dict()                      # DTensors under FSDP2: each rank gets its shard
    dcp.load(sd, storage_reader=Reader("ckpt/step_00001000"))
    model.load_state_dict(sd)

Names: parameters and buffers under their manifest names (``prefix`` prepended, e.g. ``prefix="model."`` for
``dcp.load({"model": sd}, ...)``), optimizer moments under ``optim/<param>/<key>`` as stored.  Nothing
else is exposed (the RNG, scheduler and data position are ckpt's ``restore``'s job).

Contract (DCP's call order, every rank): ``reset`` -> ``read_metadata`` (every rank reads the small manifest
itself) -> ``set_up_storage_reader`` -> ``prepare_local_plan`` -> (coordinator) ``prepare_global_plan`` ->
``read_data``.  Each stored shard (its box) is one DCP chunk; a read item is a box inside one chunk, read with
:meth:`ckpt.reader.CheckpointReader.read_box_into` (checksums verified), so only the bytes a rank needs are read.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckpt.dtypes import dtype_from_name
from ckpt.errors import CkptError
from ckpt.manifest import Box
from ckpt.reader import CheckpointReader

__all__ = ["Reader"]

MODEL_ROLES = ("parameter", "buffer")


class Reader(StorageReader):
    """A DCP ``StorageReader`` over one committed ckpt checkpoint (a local path or an object-store URL)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        prefix: str = "",
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
    ) -> None:
        self.path = os.fspath(path)
        self.prefix = prefix
        self.storage_options = storage_options
        self.verify = verify
        self._reader: CheckpointReader | None = None
        self._name_of: dict[str, str] = {}
        self._chunks: dict[str, list[Box]] = {}

    # -- DCP protocol ------------------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._reader = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        from ckpt.storage import open_storage

        try:
            return open_storage(os.fspath(checkpoint_id)).exists("manifest.json")
        except (CkptError, OSError, ValueError):
            return False

    def read_metadata(self) -> Metadata:
        reader = self._open()
        md: dict[str, Any] = {}
        for name, e in reader.manifest.tensors.items():
            fqn = self.prefix + name if e.role in MODEL_ROLES else name
            boxes = list(dict.fromkeys(s.box for s in e.shards if s.box.numel > 0)) or [Box.full(e.shape)]
            self._name_of[fqn] = name
            self._chunks[fqn] = boxes
            md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(e.dtype)),
                size=torch.Size(e.shape),
                chunks=[ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.lengths)) for b in boxes],
            )
        return Metadata(state_dict_metadata=md)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        if not self._name_of:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        reader = self._open()
        for item in plan.items:
            if item.type is not LoadItemType.TENSOR:
                raise CkptError(
                    f"{self.path}: {item.storage_index.fqn} is not a tensor; ckpt's reader only serves tensors"
                )
            fqn = item.storage_index.fqn
            name = self._name_of[fqn]
            chunk = self._chunk(item.storage_index)
            offsets = tuple(c + o for c, o in zip(chunk.offsets, item.storage_offsets, strict=True))
            box = Box(offsets, tuple(item.lengths))
            data = torch.empty(box.lengths, dtype=dtype_from_name(reader.entry(name).dtype))
            reader.read_box_into(name, box, data)
            target = planner.resolve_tensor(item).detach()
            if target.shape != data.shape:
                raise CkptError(
                    f"{self.path}: {fqn}: planner asked for {list(target.shape)}, read {list(data.shape)}"
                )
            target.copy_(data)
            planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- helpers -----------------------------------------------------------------------------------------
    def _open(self) -> CheckpointReader:
        if self._reader is None:
            self._reader = CheckpointReader(self.path, self.storage_options, self.verify)
        return self._reader

    def _chunk(self, index: MetadataIndex) -> Box:
        boxes = self._chunks[index.fqn]
        if index.index is not None and 0 <= index.index < len(boxes):
            return boxes[index.index]
        want = tuple(index.offset) if index.offset is not None else None
        for b in boxes:
            if b.offsets == want:
                return b
        raise CkptError(f"{self.path}: {index.fqn} has no stored chunk at {list(want or ())}")
