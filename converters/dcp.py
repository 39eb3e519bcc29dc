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

Reader (:func:`open_dcp`): ``.metadata`` is unpickled through :func:`ckpt.safe_unpickle.load_pickle` with an
explicit allow-list of DCP metadata classes (never plain pickle), each chunk is read by its offset/length and
loaded with the ``weights_only`` loader.  Memory: one full tensor plus one stored chunk.  Where DCP's format does
not allow bounding memory: nothing for tensors; a checkpoint that stores a whole tensor as a single chunk of
``n`` bytes needs ``n`` bytes, as any reader would.  Transformed (e.g. compressed) DCP streams are refused.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import pathlib
import pickle
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt import treecodec
from ckpt.dtypes import dtype_from_name, dtype_name
from ckpt.errors import CkptError, CorruptionError, LayoutError
from ckpt.layouts import Piece
from ckpt.manifest import TensorDesc
from ckpt.safe_unpickle import load_pickle, load_torch_file
from ckpt.storage import open_storage
from ckpt.storage.folder import FolderTxn, begin_folder

from .engine import (
    MODEL_ROLES,
    Conversion,
    OutPart,
    Source,
    Staging,
    Trees,
    UnitReceipt,
    check_cover,
    produce,
    slice_of,
)
from .engine.export import Progress

NAME = "dcp"

METADATA_NAME = ".metadata"
OPTIM_KEYS = ("optim", "optimizer")


def detect(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
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
    format = NAME

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
        self.tensors = {}
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
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
        self.tensors[name] = TensorDesc(
            name, role, tuple(item.size), dtype_name(item.properties.dtype), param, key
        )

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

    def read(self, piece: Piece) -> torch.Tensor:
        """A slice of one tensor; the tensor is assembled from its chunks once and kept while its slices are read
        (a small LRU: DCP stores chunks in the saver's boxes, not ours)."""
        t = self._cache.get(piece.name)
        if t is None:
            fqn = self._fqn_of[piece.name]
            t = self._cache[piece.name] = self._read_fqn(fqn, self._md.state_dict_metadata[fqn])
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return slice_of(t, piece)

    def read_anon(self, piece: Piece) -> int:
        """The whole tensor, assembled from its chunks, each read as bytes and copied (or unpickled) once more."""
        return 3 * self.stored_bytes(piece)

    def cache_bytes(self, pieces: Iterable[Piece]) -> int:
        return 2 * max((self.stored_bytes(p) for p in pieces), default=0)

    def close(self) -> None:
        self._cache.clear()


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
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += self.f.write(view[done:])
        self.n += done
        return done

    def flush(self) -> None:
        pass


class DcpExport:
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
        self._txn: FolderTxn | None = None

    def begin(self, dst: str) -> Staging:
        self._txn = begin_folder(dst, self.storage_options)
        return Staging(self._txn.url, "")

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

    def held_bytes(self, retained: Callable[[OutPart], int]) -> int:
        """Nothing: ``torch.save`` streams each item's bytes into the file as it is made (a strided view is
        copied first, which its part's ``retained`` counts)."""
        return 0

    def commit(self, staging: Staging, dst: str, receipts: list[UnitReceipt]) -> str:
        """Merge the workers' storage entries into the planner's metadata; ``.metadata`` is written last."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        receipts = check_cover(receipts, len(self.items), dst)
        if self._txn is None or self._txn.url != staging.url:
            raise CkptError(f"{dst}: commit by an export that did not begin this folder")
        entries: dict[Any, Any] = {}
        for r in receipts:
            entries.update(r.data)
        missing = [item.index for item in self.items if item.index not in entries]
        if missing or len(entries) != len(self.items):
            raise CorruptionError(
                f"{dst}: no storage entry for {len(missing)} DCP items (e.g. {missing[:1]})"
            )
        storage = self._txn.storage
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
        self._txn.commit({METADATA_NAME: pickle.dumps(metadata)})
        return dst

    def abort(self, staging: Staging) -> None:
        if self._txn is not None:
            self._txn.abort()


def export(
    conv: Conversion, *, storage_options: dict[str, Any] | None = None, verify: bool = True, **_: Any
) -> DcpExport:
    return DcpExport(conv, storage_options=storage_options, verify=verify)


__all__ = ["DCPSource", "DcpExport", "detect", "export", "open_source", "read_metadata"]
