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
``dcp.load({"model": sd}, ...)``), optimizer moments under ``optim/<param>/<key>`` as stored, and the
non-tensor values a :class:`Writer` stored (``user.dcp``).  The RNG, scheduler and data position of a checkpoint
saved by ckpt itself are ckpt ``restore``'s job.

:class:`Writer` is the other direction, ``dcp.save(state_dict, storage_writer=Writer(path, step=N))``: every
rank streams its DTensor shards (the chunks DCP's planner gives it) into its own data files, and the coordinator
commits one manifest with all ranks' boxes.  Tensors keep their FQNs (``prefix`` stripped); ``optim/<p>/<k>``
names are optimizer moments.  Non-tensor values (a step counter, hyper-parameters) are stored in the manifest as
JSON (``user.dcp``), never pickled; a value JSON cannot hold is refused with its FQN.

Contract (DCP's call order, every rank): ``reset`` -> ``read_metadata`` (every rank reads the small manifest
itself) -> ``set_up_storage_reader`` -> ``prepare_local_plan`` -> (coordinator) ``prepare_global_plan`` ->
``read_data``.  Each stored shard (its box) is one DCP chunk; a read item is a box inside one chunk, read with
:meth:`ckpt.format.reader.CheckpointReader.read_box_into` (checksums verified), so only the bytes a rank needs are read.
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckpt.errors import CkptError
from ckpt.format.dtypes import dtype_from_name
from ckpt.format.manifest import Box, Layout
from ckpt.format.reader import CheckpointReader

__all__ = ["Reader", "Writer"]

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
        self._values: dict[str, Any] = {}

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
        self._values = (
            dict((reader.manifest.user or {}).get("dcp") or {})
            if isinstance(reader.manifest.user, dict)
            else {}
        )
        for fqn in self._values:
            md[fqn] = BytesStorageMetadata()
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
            fqn = item.storage_index.fqn
            if item.type is LoadItemType.BYTE_IO:
                from ckpt.format import treecodec

                buf = io.BytesIO()
                torch.save(treecodec.decode(self._values[fqn]), buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
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


OPTIM = "optim/"


def _backend(devices: set[str]) -> str:
    """The manifest's ``backend`` from the device types the saved tensors lived on (``cuda``, ``xla``, ``cpu``)."""
    if "cuda" in devices:
        return "cuda"
    if "xla" in devices or "neuron" in devices:
        return "neuron"
    return "cpu"


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` that writes one ckpt checkpoint (see the module docstring).

    Call order (DCP's): every rank ``set_up_storage_writer`` -> ``prepare_local_plan``; the coordinator
    ``prepare_global_plan`` (gives every rank its writer number and one attempt id, in the plans' storage
    data) -> every rank ``write_data`` (its own data files; the receipt travels back in its first result) ->
    the coordinator ``finish`` (builds the manifest from DCP's metadata and all receipts, publishes it last).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        step: int = 0,
        prefix: str = "",
        storage_options: dict[str, Any] | None = None,
        codec: str = "raw",
    ) -> None:
        self.path = os.fspath(path)
        self.step = step
        self.prefix = prefix
        self.storage_options = storage_options
        self.codec = codec
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if is_coordinator:
            from ckpt.storage import open_storage

            if open_storage(self.path, self.storage_options).exists("manifest.json"):
                raise CkptError(f"{self.path}: a checkpoint is already there; choose a new path")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        attempt = uuid.uuid4().hex[:8]
        return [dataclasses.replace(p, storage_data=(i, attempt)) for i, p in enumerate(plans)]

    def _name(self, fqn: str) -> str:
        return fqn[len(self.prefix) :] if self.prefix and fqn.startswith(self.prefix) else fqn

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        from ckpt.format import treecodec
        from ckpt.saving.writer import StreamingWriter

        rank, attempt = plan.storage_data
        writer = StreamingWriter(
            self.path, rank=rank, attempt=attempt, codec=self.codec, storage_options=self.storage_options
        )
        results: list[WriteResult] = []
        values: dict[str, Any] = {}
        devices: set[str] = set()  # where the tensors lived: the manifest's backend
        sharded = False  # a box smaller than its tensor: DTensor shards (else whole tensors)
        try:
            for item in plan.items:
                fqn = item.index.fqn
                if item.type is WriteItemType.BYTE_IO:
                    obj = planner.lookup_object(item.index) if hasattr(planner, "lookup_object") else None
                    values[fqn] = treecodec.encode(obj, fqn)
                    results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
                    continue
                td = item.tensor_data
                assert td is not None
                data = planner.resolve_data(item).detach()
                devices.add(data.device.type)
                sharded = sharded or tuple(td.chunk.sizes) != tuple(td.size)
                name = self._name(fqn)
                role, param, key = "parameter", None, None
                if name.startswith(OPTIM) and name.count("/") >= 2:
                    param, _, key = name[len(OPTIM) :].rpartition("/")
                    role = "optimizer_state"
                box = Box(tuple(td.chunk.offsets), tuple(td.chunk.sizes))
                writer.add(name, data, role=role, shape=tuple(td.size), box=box, param=param, key=key)
                results.append(
                    WriteResult(
                        index=item.index, size_in_bytes=data.numel() * data.element_size(), storage_data=None
                    )
                )
            receipt = writer.finish()
        except BaseException:
            writer.abort()
            raise
        finally:
            writer.close()
        carried = (receipt, values, (sorted(devices), sharded))
        if results:
            results[0] = dataclasses.replace(results[0], storage_data=carried)
        else:
            results.append(
                WriteResult(index=MetadataIndex(f"$ckpt-rank-{rank}"), size_in_bytes=0, storage_data=carried)
            )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        from ckpt.format.dtypes import dtype_name
        from ckpt.format.manifest import TensorDesc
        from ckpt.format.publish import build_manifest, publish
        from ckpt.storage import open_storage

        receipts, values = [], {}
        devices: set[str] = set()
        sharded = False
        for per_rank in results:
            carried = [r.storage_data for r in per_rank if r.storage_data is not None]
            for receipt, vals, (devs, shards) in carried:
                receipts.append(receipt)
                values.update(vals)
                devices.update(devs)
                sharded = sharded or shards
        metas = []
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            name = self._name(fqn)
            role, param, key = "parameter", None, None
            if name.startswith(OPTIM) and name.count("/") >= 2:
                param, _, key = name[len(OPTIM) :].rpartition("/")
                role = "optimizer_state"
            metas.append(TensorDesc(name, role, tuple(md.size), dtype_name(md.properties.dtype), param, key))
        trees: dict[str, Any] = {
            "optimizer": None, "scheduler": None, "scaler": None, "rng": {}, "progress": {"step": self.step},
            "data": {}, "tokenizer": None, "user": {"dcp": values} if values else None, "extra": {},
        }  # fmt: skip
        layout = Layout(world_size=len(results), kind="dtensor" if sharded else "replicated")
        manifest = build_manifest(
            step=self.step,
            backend=_backend(devices),
            layout=layout,
            metas=metas,
            receipts=receipts,
            trees=trees,
        )
        publish(open_storage(self.path, self.storage_options), manifest)
