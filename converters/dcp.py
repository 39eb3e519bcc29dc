"""torch.distributed.checkpoint (DCP) folders: ``.metadata`` + ``__<rank>_<n>.distcp`` files.

Writer (:func:`write_dcp`): the CUDA form of a checkpoint as ``{"model": model_state_dict, "optim":
optimizer_state_dict}`` exactly as ``torch.distributed.checkpoint.state_dict.get_state_dict`` names it (FQN-keyed
``state`` and ``param_groups``), so ``dcp.load`` fills an FSDP2-sharded model and its optimizer state dict, and
``set_state_dict`` applies them.  DCP's own ``DefaultSavePlanner`` computes the keys and the metadata from
shape-only (``meta``) placeholders; we then stream each tensor in (one ``torch.save`` blob per tensor, DCP's
default serialization) and write ``.metadata`` last, in a temp folder renamed into place.  Memory: one tensor.
Parallel (:class:`DcpExport`): each worker writes its items into its own ``__<w>_0.distcp``, the coordinator
merges their storage entries into ``.metadata``: DCP's own multi-rank layout.  ``.metadata`` is pickled here as
DCP's ``FileSystemWriter.finish`` pickles it; that it loads with the DCP of every supported torch (2.6 to 2.9) is
checked by ``.ci/dcp_compat.sh`` (docs/convert.md, "DCP compatibility").

Reader: :mod:`ckpt.converters.dcp_source`.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import pickle
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CorruptionError, LayoutError
from ckpt.format import treecodec
from ckpt.format.dtypes import dtype_from_name
from ckpt.storage import open_storage

from .dcp_source import METADATA_NAME, DCPSource, read_metadata
from .engine import (
    MODEL_ROLES,
    Conversion,
    OutPart,
    Staging,
    UnitReceipt,
    check_cover,
    produce,
)
from .engine.export import Progress
from .folder_export import FolderExport, write_all

NAME = "dcp"



def detect(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    return (Path(path) / METADATA_NAME).is_file()


def open_source(
    path: str, *, config: Mapping[str, Any] | None = None, step: int | None = None, **_: Any
) -> DCPSource:
    """A lazy reader over a DCP folder."""
    return DCPSource(path, config=dict(config) if config is not None else None, step=step or 0)


def _state_dict_skeleton(conv: Conversion) -> tuple[dict[str, Any], dict[tuple[Any, ...], str]]:
    """``{"model": ..., "optim": ...}`` with ``meta`` placeholders for tensors, and placeholder path -> target name."""
    fetch: dict[tuple[Any, ...], str] = {}
    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    for t in conv.tensors:
        d = t.desc
        placeholder = torch.empty(d.shape, dtype=dtype_from_name(d.dtype), device="meta")
        if d.role in MODEL_ROLES:
            model[d.name] = placeholder
            fetch[("model", d.name)] = d.name
        elif d.role == "optimizer_state" and d.param is not None and d.key is not None:
            state.setdefault(d.param, {})[d.key] = placeholder
            fetch[("optim", "state", d.param, d.key)] = d.name
    sd: dict[str, Any] = {"model": model}
    opt = conv.trees.optimizer
    if opt is not None:
        for param, per in opt.get("state", {}).items():
            for key, value in per.items():
                state.setdefault(param, {})[key] = treecodec.decode(value)
        groups = []
        for g in opt.get("param_groups", []):
            gd = {k: treecodec.decode(v) for k, v in g.items() if k != "params"}
            gd["params"] = list(g["params"])
            groups.append(gd)
        # get_state_dict orders state by parameter; keep the param_groups order
        order = [p for g in groups for p in g["params"]]
        ordered = {p: state[p] for p in order if p in state}
        ordered.update({p: v for p, v in state.items() if p not in ordered})
        sd["optim"] = {"state": ordered, "param_groups": groups}
    return sd, fetch


def check_export(conv: Conversion) -> None:
    if conv.to != "cuda":
        raise LayoutError(
            "--format dcp holds the CUDA layout (FSDP2 loads full tensors and reshards them); use --to cuda"
        )


def distcp_name(worker: int) -> str:
    """Data file of worker ``worker``: DCP's own per-rank name ``__<rank>_0.distcp`` (one file per writer)."""
    return f"__{worker}_0.distcp"


class _Counting:
    """A write-only file wrapper that counts bytes (``torch.save`` streams into it; no per-item buffer)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.n = 0

    def write(self, data: Any) -> int:
        done = write_all(self.f, data)
        self.n += done
        return done

    def flush(self) -> None:
        pass


class DcpExport(FolderExport):
    """A DCP folder as an :class:`~converters.engine.Export`: one unit = one DCP write item (a tensor or a bytes
    blob), written by worker ``w`` into its own ``__<w>_0.distcp``; ``.metadata`` is the commit.

    This is DCP's own multi-rank layout: ``.metadata`` maps every item to ``(relative_path, offset, length)``, so
    ``dcp.load`` (any world size) reads items from whichever file holds them.  Every worker builds the same
    ``DefaultSavePlanner`` plan from the same ``meta`` skeleton (deterministic), so items need no exchange; each
    worker returns the storage entries of its items and the coordinator merges them into the metadata.
    """

    def __init__(
        self, conv: Conversion, *, storage_options: dict[str, Any] | None = None, verify: bool = True
    ) -> None:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.planner import WriteItemType

        check_export(conv)
        self.conv = conv
        self.storage_options = storage_options
        self.verify = verify
        sd, self.fetch = _state_dict_skeleton(conv)
        self.planner = DefaultSavePlanner()
        self.planner.set_up_planner(sd, storage_meta=None, is_coordinator=True)
        local = self.planner.create_local_plan()
        global_plans, self.metadata = self.planner.create_global_plan([local])
        self.items = list(self.planner.finish_plan(global_plans[0]).items)
        self.paths: dict[str, tuple[Any, ...]] = dict(self.metadata.planner_data or {})
        self.outs = {t.desc.name: t for t in conv.tensors}
        self.weights = [
            0
            if item.type == WriteItemType.BYTE_IO
            else math.prod(int(n) for n in item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
            for item in self.items
        ]

    def write(
        self, staging: Staging, units: Sequence[int], progress: Progress = None, *, worker: int = 0
    ) -> UnitReceipt:
        """Stream items ``units`` (one ``torch.save`` blob each, DCP's default) into ``__<worker>_0.distcp``."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.planner import WriteItemType

        entries: dict[Any, Any] = {}
        if not units:
            return UnitReceipt(worker, (), entries)
        planner = self.planner
        fname = distcp_name(worker)
        with open_storage(staging.url, self.storage_options).create(fname) as f:
            offset = 0
            for u in units:
                item = self.items[u]
                buf = _Counting(f)
                if item.type == WriteItemType.BYTE_IO:
                    buf.write(planner.resolve_data(item).getbuffer())
                else:
                    fqn = item.index.fqn
                    name = self.fetch.get(tuple(self.paths.get(fqn, (fqn,))))
                    if name is None:  # a real (small) tensor, e.g. Adam's step
                        tensor = planner.resolve_data(item)
                    else:
                        (part,) = self.outs[name].parts
                        tensor = produce(self.conv, part, verify=self.verify)
                        if progress is not None:
                            progress(self.outs[name].desc.nbytes)
                    chunk = item.tensor_data.chunk
                    for d, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                        if o != 0 or n != tensor.shape[d]:
                            tensor = tensor.narrow(d, o, n)
                    tensor = tensor.detach().cpu().contiguous()
                    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                        tensor = tensor.clone()
                    torch.save(tensor, buf)
                    del tensor
                    # torch.save leaves a reference cycle holding the storages it wrote until the cyclic GC runs:
                    # break it now, or fresh tensors pile up (memory would grow with the model, not one item)
                    gc.collect(1)
                entries[item.index] = _StorageInfo(fname, offset, buf.n)
                offset += buf.n
        return UnitReceipt(worker, tuple(units), entries)

    def unit_parts(self, unit: int) -> Sequence[OutPart]:
        """The parts write item ``unit`` is cut from (none for a bytes item or a small state the planner holds)."""
        fqn = self.items[unit].index.fqn
        name = self.fetch.get(tuple(self.paths.get(fqn, (fqn,))))
        return self.outs[name].parts if name is not None else ()

    def commit(self, staging: Staging, dst: str, receipts: list[UnitReceipt]) -> str:
        """Merge the workers' storage entries into the planner's metadata; ``.metadata`` is written last."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        receipts = check_cover(receipts, len(self.items), dst)
        txn = self.begun(staging, dst)
        entries: dict[Any, Any] = {}
        for r in receipts:
            entries.update(r.data)
        missing = [item.index for item in self.items if item.index not in entries]
        if missing or len(entries) != len(self.items):
            raise CorruptionError(
                f"{dst}: no storage entry for {len(missing)} DCP items (e.g. {missing[:1]})"
            )
        storage = txn.storage
        for info in entries.values():
            size = storage.size(info.relative_path)
            if size is None or size < info.offset + info.length:
                raise CorruptionError(f"{dst}: {info.relative_path} is shorter than its items")
        metadata = dataclasses.replace(self.metadata)
        if hasattr(metadata, "version"):
            from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

            metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {item.index: entries[item.index] for item in self.items}
        metadata.storage_meta = StorageMeta(checkpoint_id=str(dst), save_id=uuid.uuid4().hex)
        txn.commit({METADATA_NAME: pickle.dumps(metadata)})
        return dst


def export(
    conv: Conversion, *, storage_options: dict[str, Any] | None = None, verify: bool = True, **_: Any
) -> DcpExport:
    return DcpExport(conv, storage_options=storage_options, verify=verify)


__all__ = ["DCPSource", "DcpExport", "detect", "export", "open_source", "read_metadata"]
