"""Reading torch.distributed.checkpoint (DCP) folders (:class:`DCPSource`).

``.metadata`` is unpickled through :func:`ckpt.safe_unpickle.load_pickle` with an explicit allow-list of DCP metadata classes (never plain pickle).  Each ``.distcp`` file is memory-mapped (private,
copy-on-write) and a chunk is loaded where it lies (storage entry: file, offset, length) by
:func:`ckpt.safe_unpickle.load_torch_buffer`: torch's ``weights_only`` unpickler over the item's small pickle, the
tensor a view of the mapped bytes.  A requested slice inside one chunk (DCP's default: one chunk per tensor, or per
FSDP shard) is a view: no anonymous memory, only the page cache of the bytes used; a slice spanning chunks is one new
tensor of the slice, copied from the chunks' overlaps.  Never the whole tensor, unless it is what is asked for.
Transformed (e.g. compressed) DCP streams are refused.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pathlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CkptError, CorruptionError
from ckpt.format import treecodec
from ckpt.format.dtypes import dtype_name
from ckpt.format.manifest import TensorDesc
from ckpt.layouts import Piece
from ckpt.safe_unpickle import load_pickle, load_torch_buffer, load_torch_file

from .engine import (
    Source,
    Trees,
)

NAME = "dcp"
METADATA_NAME = ".metadata"
OPTIM_KEYS = ("optim", "optimizer")


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
    #: the top-level keys holding an optimizer state dict (Lightning's FSDP folder: ``optimizer_0``)
    optim_keys: tuple[str, ...] = OPTIM_KEYS

    def __init__(self, path: str | Path, *, config: dict[str, Any] | None = None, step: int = 0) -> None:
        self.root = Path(path)
        self.path = str(self.root)
        self.config = config
        md = read_metadata(self.root)
        self._md = md
        mapping: dict[str, tuple[Any, ...]] = dict(md.planner_data or {})
        by_fqn: dict[str, dict[tuple[int, ...] | None, Any]] = {}
        for idx, info in (md.storage_data or {}).items():
            off = tuple(idx.offset) if idx.offset is not None else None
            by_fqn.setdefault(idx.fqn, {})[off] = info
        self._by_fqn = by_fqn
        self.tensors = {}
        self._maps: dict[Path, mmap.mmap | None] = {}
        self._chunks_loaded: OrderedDict[tuple[str, tuple[int, ...]], torch.Tensor] = OrderedDict()
        self._fqn_of: dict[str, str] = {}
        groups: dict[int, dict[str, Any]] = {}
        scalars: dict[str, dict[str, Any]] = {}
        ignored: list[str] = []
        for fqn, item in md.state_dict_metadata.items():
            path_ = tuple(mapping.get(fqn, (fqn,)))
            is_tensor = type(item).__name__ == "TensorStorageMetadata"
            if path_[0] in self.optim_keys and len(path_) == 4 and path_[1] == "state":
                param, key = str(path_[2]), str(path_[3])
                if is_tensor and len(item.size) > 0:
                    name = f"optim/{param}/{key}"
                    self._add_tensor(name, fqn, item, "optimizer_state", param, key)
                else:
                    scalars.setdefault(param, {})[key] = treecodec.encode(self._read_any(fqn, item), fqn)
            elif path_[0] in self.optim_keys and len(path_) == 4 and path_[1] == "param_groups":
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
        self.step_recorded = False

    def _add_tensor(
        self, name: str, fqn: str, item: Any, role: str, param: str | None = None, key: str | None = None
    ) -> None:
        self._fqn_of[name] = fqn
        self.tensors[name] = TensorDesc(
            name, role, tuple(item.size), dtype_name(item.properties.dtype), param, key
        )

    def _storage(self, fqn: str, offset: tuple[int, ...] | None) -> tuple[Any, Path]:
        """The storage entry of item ``fqn`` at ``offset`` (a chunk's offsets; ``None`` for a bytes item), checked."""
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
        return info, self.root / rel

    def _map(self, file: Path) -> mmap.mmap | None:
        """A private (copy-on-write) map of a ``.distcp`` file, opened once; ``None`` for an empty file."""
        if file not in self._maps:
            with open(file, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        return self._maps[file]

    def _blob(self, fqn: str, offset: tuple[int, ...] | None) -> bytes:
        """The bytes of a (small) bytes item: ``param_groups`` entries, pickled scalars."""
        info, file = self._storage(fqn, offset)
        with open(file, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise CorruptionError(f"{file}: truncated ({fqn} needs {info.length} bytes at {info.offset})")
        return data

    def _read_any(self, fqn: str, item: Any) -> Any:
        if type(item).__name__ == "TensorStorageMetadata":
            return self._region(fqn, item, (0,) * len(item.size), tuple(int(n) for n in item.size)).clone()
        return load_torch_file(io.BytesIO(self._blob(fqn, None)))

    def _chunk(self, fqn: str, item: Any, offs: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """One stored chunk as a view of its memory-mapped ``.distcp`` file (nothing read until it is used)."""
        key = (fqn, offs)
        t = self._chunks_loaded.get(key)
        if t is not None:
            self._chunks_loaded.move_to_end(key)
            return t
        info, file = self._storage(fqn, offs)
        mm = self._map(file)
        size = len(mm) if mm is not None else 0
        if info.offset + info.length > size:
            raise CorruptionError(f"{file}: truncated ({fqn} needs {info.length} bytes at {info.offset})")
        dtype = item.properties.dtype
        where = f"{file} ({fqn} at {list(offs)})"
        if bytes(mm[info.offset : info.offset + 2]) == b"PK":  # type: ignore[index]
            t = load_torch_buffer(mm, info.offset, info.length, where=where)
        else:  # raw bytes (no torch.save framing)
            n = torch.Size(sizes).numel() * dtype.itemsize
            if info.length != n:
                raise CorruptionError(f"{where}: {info.length} raw bytes, expected {n} for {list(sizes)}")
            t = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=info.offset).view(dtype)
        if not isinstance(t, torch.Tensor) or t.numel() != torch.Size(sizes).numel() or t.dtype != dtype:
            got = f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CorruptionError(f"{where}: holds {got}, expected {list(sizes)} {dtype}")
        t = self._chunks_loaded[key] = t.reshape(sizes)
        while len(self._chunks_loaded) > 16:
            self._chunks_loaded.popitem(last=False)
        return t

    def _cover(
        self, item: Any, offs: tuple[int, ...], lengths: tuple[int, ...]
    ) -> list[tuple[Any, list[slice]]]:
        """The stored chunks overlapping the box ``offs``/``lengths``, each with its overlap (box coordinates)."""
        out = []
        for chunk in item.chunks:
            co = tuple(int(x) for x in chunk.offsets)
            cs = tuple(int(x) for x in chunk.sizes)
            lo = [max(a, b) for a, b in zip(co, offs, strict=True)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(co, cs, offs, lengths, strict=True)]
            if all(h > lo_ for lo_, h in zip(lo, hi, strict=True)):
                out.append(((co, cs), [slice(a, b) for a, b in zip(lo, hi, strict=True)]))
        return out

    def _region(self, fqn: str, item: Any, offs: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
        """The box of tensor ``fqn``: a view of the one chunk holding it, else assembled from the chunks' overlaps."""
        cover = self._cover(item, offs, lengths)
        if len(cover) == 1:
            (co, cs), ov = cover[0]
            if all(s.stop - s.start == n for s, n in zip(ov, lengths, strict=True)):
                t = self._chunk(fqn, item, co, cs)
                for d, (s, c) in enumerate(zip(ov, co, strict=True)):
                    if s.start != c or s.stop - s.start != t.shape[d]:
                        t = t.narrow(d, s.start - c, s.stop - s.start)
                return t
        out = torch.empty(lengths, dtype=item.properties.dtype)
        filled = 0
        for (co, cs), ov in cover:
            t = self._chunk(fqn, item, co, cs)
            src = tuple(slice(s.start - c, s.stop - c) for s, c in zip(ov, co, strict=True))
            dst = tuple(slice(s.start - o, s.stop - o) for s, o in zip(ov, offs, strict=True))
            out[dst] = t[src]
            filled += math.prod(s.stop - s.start for s in ov)
        if filled != out.numel():
            raise CorruptionError(
                f"{self.path}: the chunks of {fqn} cover {filled} of the {out.numel()} elements of "
                f"{list(lengths)} at {list(offs)}"
            )
        return out

    def _box(self, piece: Piece) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shape = self.tensors[piece.name].shape
        offs, lengths = [0] * len(shape), list(shape)
        if piece.dim is not None:
            offs[piece.dim], lengths[piece.dim] = piece.start, piece.length
        return tuple(offs), tuple(lengths)

    def read(self, piece: Piece) -> torch.Tensor:
        """A slice of one tensor: a view of the memory-mapped chunk that holds it (DCP's default, one chunk per
        tensor or per FSDP shard), or, when the slice spans chunks, a new tensor of the slice copied from them."""
        fqn = self._fqn_of[piece.name]
        return self._region(fqn, self._md.state_dict_metadata[fqn], *self._box(piece))

    def read_anon(self, piece: Piece) -> int:
        """Nothing for a slice inside one chunk (a view of the mapped file); the slice when it spans chunks."""
        fqn = self._fqn_of[piece.name]
        cover = self._cover(self._md.state_dict_metadata[fqn], *self._box(piece))
        return self.piece_bytes(piece) if len(cover) != 1 else 0

    def close(self) -> None:
        self._chunks_loaded.clear()
        self._maps.clear()  # each map closes when the last view of it goes
