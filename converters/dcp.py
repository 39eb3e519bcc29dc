"""torch.distributed.checkpoint (DCP) folders: ``.metadata`` + ``__<rank>_<n>.distcp`` files.

Writer (:func:`write_dcp`): the CUDA form of a checkpoint as ``{"model": model_state_dict, "optim":
optimizer_state_dict}`` exactly as ``torch.distributed.checkpoint.state_dict.get_state_dict`` names it (FQN-keyed
``state`` and ``param_groups``), so ``dcp.load`` fills an FSDP2-sharded model and its optimizer state dict, and
``set_state_dict`` applies them.  DCP's own ``DefaultSavePlanner`` computes the keys and the metadata from
shape-only (``meta``) placeholders; we then stream each tensor in (one ``torch.save`` blob per tensor, DCP's
default serialization) and write ``.metadata`` last, in a temp folder renamed into place.  Memory: one tensor.
Parallel (:class:`DcpExport`): each worker writes its items into its own ``__<w>_0.distcp``, the coordinator
merges their storage entries into ``.metadata``: DCP's own multi-rank layout.

Reader (:func:`open_dcp`): ``.metadata`` is unpickled through :func:`ckpt.safe_unpickle.load_pickle` with an
explicit allow-list of DCP metadata classes (never plain pickle), each chunk is read by its offset/length and
loaded with the ``weights_only`` loader.  Memory: one full tensor plus one stored chunk.  Where DCP's format does
not allow bounding memory: nothing for tensors; a checkpoint that stores a whole tensor as a single chunk of
``n`` bytes needs ``n`` bytes, as any reader would.  Transformed (e.g. compressed) DCP streams are refused.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import pickle
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt import treecodec
from ckpt.errors import CkptError, CorruptionError, LayoutError
from ckpt.safe_unpickle import load_pickle, load_torch_file

from .ckpt_layout import MODEL_ROLES, Conversion, Source, TensorCache, TensorInfo, Trees
from .fsutil import make_temp_dir, publish_dir, remove_dir
from .parallel import UnitReceipt, check_cover, write_serial

METADATA_NAME = ".metadata"
OPTIM_KEYS = ("optim", "optimizer")


def is_dcp_dir(path: str | Path) -> bool:
    return (Path(path) / METADATA_NAME).is_file()


def _allowed() -> dict[tuple[str, str], Any]:
    """The globals a DCP ``.metadata`` pickle may reference: inert metadata classes, dtypes, ``torch.Size``."""
    import torch.distributed.checkpoint.filesystem as fsm
    import torch.distributed.checkpoint.metadata as md

    allowed: dict[tuple[str, str], Any] = {}
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ):
        allowed[(md.__name__, name)] = getattr(md, name)
    allowed[(fsm.__name__, "_StorageInfo")] = fsm._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath
    allowed[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
    for attr in dir(torch):
        value = getattr(torch, attr, None)
        if isinstance(value, torch.dtype):
            allowed[("torch", attr)] = value
    return allowed


def read_metadata(path: str | Path) -> Any:
    """DCP's ``Metadata`` object of the folder at ``path``, loaded without executing anything from it."""
    p = Path(path) / METADATA_NAME
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise CkptError(f"{path}: not a DCP checkpoint ({METADATA_NAME} missing)") from None
    md = load_pickle(raw, _allowed(), where=str(p))
    if type(md).__name__ != "Metadata":
        raise CorruptionError(f"{p}: holds a {type(md).__name__}, expected DCP Metadata")
    return md


class DCPSource(Source):
    """A DCP folder as a CUDA-layout source.

    Keys are classified by DCP's flattening paths (``planner_data``): ``("model", name)`` (or a bare name) is a
    model tensor; ``(optim, "state", param, key)`` an optimizer state (0-dim ones, like Adam's ``step``, become
    scalar state); ``(optim, "param_groups", i, key)`` a param_group entry.  Other keys are listed in
    ``extra.dcp_ignored``.
    """

    layout = "cuda"
    format = "dcp"

    def __init__(self, path: str | Path, *, config: dict[str, Any] | None = None, step: int = 0) -> None:
        self.root = Path(path)
        self.path = str(self.root)
        self.config = config
        md = read_metadata(self.root)
        self._md = md
        mapping: dict[str, tuple[Any, ...]] = dict(md.planner_data or {})
        self._chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], Any]]] = {}
        by_fqn: dict[str, dict[tuple[int, ...] | None, Any]] = {}
        for idx, info in (md.storage_data or {}).items():
            off = tuple(idx.offset) if idx.offset is not None else None
            by_fqn.setdefault(idx.fqn, {})[off] = info
        self._by_fqn = by_fqn
        self.infos = {}
        self._fqn_of: dict[str, str] = {}
        groups: dict[int, dict[str, Any]] = {}
        scalars: dict[str, dict[str, Any]] = {}
        ignored: list[str] = []
        for fqn, item in md.state_dict_metadata.items():
            path_ = tuple(mapping.get(fqn, (fqn,)))
            is_tensor = type(item).__name__ == "TensorStorageMetadata"
            if path_[0] in OPTIM_KEYS and len(path_) == 4 and path_[1] == "state":
                param, key = str(path_[2]), str(path_[3])
                if is_tensor and len(item.size) > 0:
                    name = f"optim/{param}/{key}"
                    self._add_tensor(name, fqn, item, "optimizer_state", param, key)
                else:
                    scalars.setdefault(param, {})[key] = treecodec.encode(self._read_any(fqn, item), fqn)
            elif path_[0] in OPTIM_KEYS and len(path_) == 4 and path_[1] == "param_groups":
                groups.setdefault(int(path_[2]), {})[str(path_[3])] = self._read_any(fqn, item)
            elif is_tensor and (len(path_) == 1 or (path_[0] == "model" and len(path_) == 2)):
                self._add_tensor(str(path_[-1]), fqn, item, "parameter")
            else:
                ignored.append(fqn)
        optimizer = None
        if groups or scalars:
            enc_groups = []
            for i in sorted(groups):
                g = groups[i]
                enc = {
                    k: treecodec.encode(v, f"param_groups[{i}].{k}") for k, v in g.items() if k != "params"
                }
                enc["params"] = [str(p) for p in g.get("params", [])]
                enc_groups.append(enc)
            optimizer = {"type": "torch.optim.Optimizer", "param_groups": enc_groups, "state": scalars}
        extra: dict[str, Any] = {}
        if config is not None:
            extra["config"] = config
        if ignored:
            extra["dcp_ignored"] = ignored
        self.trees = Trees(step=step, optimizer=optimizer, progress={"step": step}, extra=extra)

    def _add_tensor(
        self, name: str, fqn: str, item: Any, role: str, param: str | None = None, key: str | None = None
    ) -> None:
        self._fqn_of[name] = fqn
        self.infos[name] = TensorInfo(name, tuple(item.size), item.properties.dtype, role, param, key)

    def _blob(self, fqn: str, offset: tuple[int, ...] | None) -> bytes:
        info = self._by_fqn.get(fqn, {}).get(offset)
        if info is None:
            raise CorruptionError(f"{self.path}: no storage entry for {fqn} at {offset}")
        if getattr(info, "transform_descriptors", None):
            raise CkptError(
                f"{self.path}: {fqn} is stored with transforms {info.transform_descriptors}; not supported"
            )
        rel = Path(info.relative_path)
        if rel.is_absolute() or ".." in rel.parts:
            raise CorruptionError(f"{self.path}/{METADATA_NAME}: unsafe file name {info.relative_path!r}")
        with open(self.root / rel, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise CorruptionError(
                f"{self.root / rel}: truncated ({fqn} needs {info.length} bytes at {info.offset})"
            )
        return data

    def _read_any(self, fqn: str, item: Any) -> Any:
        if type(item).__name__ == "TensorStorageMetadata":
            return self._read_fqn(fqn, item)
        return load_torch_file(io.BytesIO(self._blob(fqn, None)))

    def _read_fqn(self, fqn: str, item: Any) -> torch.Tensor:
        dtype = item.properties.dtype
        out = torch.empty(tuple(item.size), dtype=dtype)
        for chunk in item.chunks:
            offs = tuple(int(x) for x in chunk.offsets)
            sizes = tuple(int(x) for x in chunk.sizes)
            raw = self._blob(fqn, offs)
            if raw[:2] == b"PK":
                t = load_torch_file(io.BytesIO(raw))
            else:
                t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
            if not isinstance(t, torch.Tensor) or t.numel() != torch.Size(sizes).numel():
                raise CorruptionError(
                    f"{self.path}: chunk of {fqn} at {list(offs)} does not hold {list(sizes)}"
                )
            idx = tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))
            out[idx] = t.reshape(sizes)
        return out

    def read(self, name: str) -> torch.Tensor:
        fqn = self._fqn_of[name]
        return self._read_fqn(fqn, self._md.state_dict_metadata[fqn])


def open_dcp(path: str | Path, *, config: dict[str, Any] | None = None, step: int = 0) -> DCPSource:
    """A lazy reader over a DCP folder."""
    return DCPSource(path, config=config, step=step)


def _state_dict_skeleton(conv: Conversion) -> tuple[dict[str, Any], dict[tuple[Any, ...], str]]:
    """``{"model": ..., "optim": ...}`` with ``meta`` placeholders for tensors, and placeholder path -> view name."""
    fetch: dict[tuple[Any, ...], str] = {}
    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    for t in conv.tensors:
        info = t.info
        placeholder = torch.empty(info.shape, dtype=info.dtype, device="meta")
        if info.role in MODEL_ROLES:
            model[info.name] = placeholder
            fetch[("model", info.name)] = info.name
        elif info.role == "optimizer_state" and info.param is not None and info.key is not None:
            state.setdefault(info.param, {})[info.key] = placeholder
            fetch[("optim", "state", info.param, info.key)] = info.name
    sd: dict[str, Any] = {"model": model}
    opt = conv.trees.optimizer
    if opt is not None:
        for param, per in opt.get("state", {}).items():
            for key, value in per.items():
                state.setdefault(param, {})[key] = treecodec.decode(value)
        groups = []
        for g in opt.get("param_groups", []):
            d = {k: treecodec.decode(v) for k, v in g.items() if k != "params"}
            d["params"] = list(g["params"])
            groups.append(d)
        # get_state_dict orders state by parameter; keep the param_groups order
        order = [p for g in groups for p in g["params"]]
        ordered = {p: state[p] for p in order if p in state}
        ordered.update({p: v for p, v in state.items() if p not in ordered})
        sd["optim"] = {"state": ordered, "param_groups": groups}
    return sd, fetch


def check_dcp_export(conv: Conversion) -> None:
    if conv.to != "cuda":
        raise LayoutError("DCP export needs --to cuda (FSDP2 loads full tensors and reshards them)")


def distcp_name(worker: int) -> str:
    """Data file of worker ``worker``: DCP's own per-rank name ``__<rank>_0.distcp`` (one file per writer)."""
    return f"__{worker}_0.distcp"


class DcpExport:
    """A DCP folder as units for :mod:`~converters.parallel`: one unit = one DCP write item (a tensor or a bytes
    blob), written by worker ``w`` into its own ``__<w>_0.distcp``; ``.metadata`` is the commit.

    This is DCP's own multi-rank layout: ``.metadata`` maps every item to ``(relative_path, offset, length)``, so
    ``dcp.load`` (any world size) reads items from whichever file holds them.  Every worker builds the same
    ``DefaultSavePlanner`` plan from the same ``meta`` skeleton (deterministic), so items need no exchange; each
    worker returns the storage entries of its items and the coordinator merges them into the metadata.
    """

    def __init__(self, conv: Conversion) -> None:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.planner import WriteItemType

        check_dcp_export(conv)
        self.conv = conv
        sd, self.fetch = _state_dict_skeleton(conv)
        self.planner = DefaultSavePlanner()
        self.planner.set_up_planner(sd, storage_meta=None, is_coordinator=True)
        local = self.planner.create_local_plan()
        global_plans, self.metadata = self.planner.create_global_plan([local])
        self.items = list(self.planner.finish_plan(global_plans[0]).items)
        self.paths: dict[str, tuple[Any, ...]] = dict(self.metadata.planner_data or {})
        self.outs = {t.info.name: t for t in conv.tensors}
        self.weights = []
        for item in self.items:
            if item.type == WriteItemType.BYTE_IO:
                self.weights.append(0)
            else:
                td = item.tensor_data
                n = 1
                for size in td.chunk.sizes:
                    n *= int(size)
                self.weights.append(n * td.properties.dtype.itemsize)

    def begin(self, dst: Path) -> Path:
        return make_temp_dir(dst)

    def write(
        self,
        tmp: Path,
        units: Sequence[int],
        progress: Callable[[int], None] | None = None,
        *,
        worker: int = 0,
    ) -> UnitReceipt:
        """Stream items ``units`` (one ``torch.save`` blob each, DCP's default) into ``__<worker>_0.distcp``."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.planner import WriteItemType

        storage: dict[Any, Any] = {}
        if not units:
            return UnitReceipt(worker, (), storage)
        conv, planner = self.conv, self.planner
        cache = TensorCache(conv.view.read, capacity=3)
        fname = distcp_name(worker)
        with open(tmp / fname, "wb") as f:
            for u in units:
                item = self.items[u]
                offset = f.tell()
                if item.type == WriteItemType.BYTE_IO:
                    f.write(planner.resolve_data(item).getbuffer())
                else:
                    fqn = item.index.fqn
                    name = self.fetch.get(tuple(self.paths.get(fqn, (fqn,))))
                    if name is None:  # a real (small) tensor, e.g. Adam's step
                        tensor = planner.resolve_data(item)
                    else:
                        (_, tensor), *_ = list(conv.produce(self.outs[name], cache))
                        if progress is not None:
                            progress(self.outs[name].info.nbytes)
                    chunk = item.tensor_data.chunk
                    for d, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                        if o != 0 or s != tensor.shape[d]:
                            tensor = tensor.narrow(d, o, s)
                    tensor = tensor.detach().cpu().contiguous()
                    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                        tensor = tensor.clone()
                    torch.save(tensor, f)
                storage[item.index] = _StorageInfo(fname, offset, f.tell() - offset)
            f.flush()
            os.fsync(f.fileno())
        return UnitReceipt(worker, tuple(units), storage)

    def commit(self, tmp: Path, dst: Path, receipts: list[UnitReceipt]) -> Path:
        """Merge the workers' storage entries into the planner's metadata, write ``.metadata`` last, rename."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        receipts = check_cover(receipts, len(self.items), str(dst))
        storage: dict[Any, Any] = {}
        for r in receipts:
            storage.update(r.data)
        missing = [item.index for item in self.items if item.index not in storage]
        if missing or len(storage) != len(self.items):
            raise CorruptionError(
                f"{dst}: no storage entry for {len(missing)} DCP items (e.g. {missing[:1]})"
            )
        for info in storage.values():
            path = tmp / info.relative_path
            if not path.is_file() or path.stat().st_size < info.offset + info.length:
                raise CorruptionError(f"{dst}: {info.relative_path} is shorter than its items")
        metadata = dataclasses.replace(self.metadata)
        if hasattr(metadata, "version"):
            from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

            metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {item.index: storage[item.index] for item in self.items}
        metadata.storage_meta = StorageMeta(checkpoint_id=str(dst), save_id=uuid.uuid4().hex)
        with open(tmp / METADATA_NAME, "wb") as mf:
            pickle.dump(metadata, mf)
        publish_dir(tmp, dst)
        return dst

    def abort(self, tmp: Path) -> None:
        remove_dir(tmp)


def write_dcp(conv: Conversion, dst: str | Path, *, progress: Callable[[int], None] | None = None) -> Path:
    """Write ``conv`` (CUDA layout) as a DCP folder at ``dst`` (atomically; one data file ``__0_0.distcp``).

    One process; ``--workers N`` / torchrun run the same :class:`DcpExport` with the items spread over the
    workers (``__<w>_0.distcp`` each).
    """
    return write_serial(DcpExport(conv), dst, progress)


__all__ = ["DCPSource", "DcpExport", "is_dcp_dir", "open_dcp", "read_metadata", "write_dcp"]
