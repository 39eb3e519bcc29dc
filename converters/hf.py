"""Hugging Face checkpoints: a folder with ``config.json`` and ``model*.safetensors`` (+ index).

Reader (:func:`open_hf`): a CUDA-layout :class:`~converters.ckpt_layout.Source` over the safetensors files; each
tensor is read on its own (``safe_open``), so importing into our manifest or straight into the Neuron TP/PP
layout (to start a fine-tune on Trainium) holds one fusion group at a time.

Writer (:func:`write_hf`): sharded ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` +
``config.json``, loadable with ``transformers.AutoModelForCausalLM.from_pretrained``.  The safetensors header of
every shard is computed from the plan before any data is read, then tensors are streamed in one at a time, so
memory is one tensor whatever the shard size.  Everything is written into a hidden temp folder next to the
destination and renamed into place at the end.  Optimizer state has no place in this format and is not written.

Parallel (:class:`HFExport`): shard files are the units several workers (``--workers``, torchrun ranks) write
whole into one temp folder; the coordinator writes the index and ``config.json`` and renames.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt.dtypes import dtype_from_name, dtype_name
from ckpt.errors import CkptError, CorruptionError, LayoutError
from ckpt.shardfile import tensor_bytes

from .ckpt_layout import MODEL_ROLES, Conversion, Source, TensorCache, TensorInfo, Trees
from .fsutil import make_temp_dir, publish_dir, remove_dir
from .parallel import UnitReceipt, check_cover, write_serial

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 << 30


def is_hf_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and ((p / INDEX_NAME).is_file() or (p / SINGLE_NAME).is_file())


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (no tensor data read)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CorruptionError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise CorruptionError(f"{path}: safetensors header of {n} bytes is implausible")
        try:
            return json.loads(f.read(n))
        except ValueError as e:
            raise CorruptionError(f"{path}: unreadable safetensors header ({e})") from None


class HFSource(Source):
    """A Hugging Face model folder as a CUDA-layout source (parameters only; step from ``--step`` or 0)."""

    layout = "cuda"
    format = "hf"

    def __init__(self, path: str | Path, *, config: dict[str, Any] | None = None, step: int = 0) -> None:
        root = Path(path)
        self.path = str(root)
        if not is_hf_dir(root):
            raise CkptError(f"{root}: not a Hugging Face model folder (config.json + model*.safetensors)")
        self.config = config if config is not None else json.loads((root / "config.json").read_text())
        if (root / INDEX_NAME).is_file():
            weight_map = json.loads((root / INDEX_NAME).read_text()).get("weight_map", {})
            files = list(dict.fromkeys(weight_map.values()))
        else:
            files = [SINGLE_NAME]
        self._file_of: dict[str, Path] = {}
        self.infos = {}
        for fname in files:
            fpath = root / fname
            if Path(fname).is_absolute() or ".." in Path(fname).parts:
                raise CorruptionError(f"{root / INDEX_NAME}: unsafe shard name {fname!r}")
            for name, entry in read_header(fpath).items():
                if name == "__metadata__":
                    continue
                self._file_of[name] = fpath
                self.infos[name] = TensorInfo(name, tuple(entry["shape"]), dtype_from_name(entry["dtype"]))
        self.trees = Trees(step=step, progress={"step": step}, extra={"config": self.config})
        self._handles: dict[Path, Any] = {}

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        fpath = self._file_of[name]
        h = self._handles.get(fpath)
        if h is None:
            h = self._handles[fpath] = safe_open(str(fpath), framework="pt")
        return h.get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


def open_hf(path: str | Path, *, config: dict[str, Any] | None = None, step: int = 0) -> HFSource:
    """A lazy reader over a Hugging Face model folder."""
    return HFSource(path, config=config, step=step)


def shard_plan(infos: list[TensorInfo], max_shard_bytes: int) -> list[list[TensorInfo]]:
    """Tensors grouped into shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for info in infos:
        if shards[-1] and size + info.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(info)
        size += info.nbytes
    return [s for s in shards if s]


def _header(infos: list[TensorInfo]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for info in infos:
        header[info.name] = {
            "dtype": dtype_name(info.dtype),
            "shape": list(info.shape),
            "data_offsets": [pos, pos + info.nbytes],
        }
        pos += info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def hf_model_tensors(conv: Conversion) -> list[int]:
    """Indices of the target tensors that go into an HF folder (model parameters and buffers)."""
    if conv.to != "cuda":
        raise LayoutError("Hugging Face export needs --to cuda (full tensors)")
    return [i for i, t in enumerate(conv.tensors) if t.info.role in MODEL_ROLES]


def check_hf_export(conv: Conversion) -> None:
    """Fail before any work when the export cannot produce a loadable folder."""
    hf_model_tensors(conv)
    if not conv.config:
        raise LayoutError("Hugging Face export needs the model config; pass --config config.json")


def shard_file_name(k: int, n: int) -> str:
    """HF's name for shard ``k`` (0-based) of ``n``."""
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


class HFExport:
    """An HF folder as units for :mod:`~converters.parallel`: one unit = one whole shard file.

    A safetensors file is a header followed by its tensors' bytes, so a shard cannot be split between writers;
    shards are independent, so any worker can write any of them.  The index and ``config.json`` are the commit.
    The shard plan depends only on the conversion plan and ``max_shard_bytes``, so every worker agrees on it.
    """

    def __init__(self, conv: Conversion, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        check_hf_export(conv)
        self.conv = conv
        indices = hf_model_tensors(conv)
        self.outs = {conv.tensors[i].info.name: conv.tensors[i] for i in indices}
        self.shards = shard_plan([conv.tensors[i].info for i in indices], max_shard_bytes)
        self.names = [shard_file_name(k, len(self.shards)) for k in range(len(self.shards))]
        self.weights = [sum(info.nbytes for info in shard) for shard in self.shards]

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
        """Write shard files ``units`` (header from the plan, then tensors streamed one at a time), fsynced."""
        conv = self.conv
        cache = TensorCache(conv.view.read, capacity=3)
        sizes: dict[str, int] = {}
        for k in units:
            shard, fname = self.shards[k], self.names[k]
            with open(tmp / fname, "wb") as f:
                f.write(_header(shard))
                for info in shard:
                    for _, data in conv.produce(self.outs[info.name], cache):
                        data = data.contiguous()
                        if data.dtype != info.dtype or tuple(data.shape) != info.shape:
                            raise CorruptionError(f"{info.name}: produced {list(data.shape)} {data.dtype}")
                        f.write(tensor_bytes(data))
                    if progress is not None:
                        progress(info.nbytes)
                f.flush()
                os.fsync(f.fileno())
                sizes[fname] = f.tell()
        return UnitReceipt(worker, tuple(units), sizes)

    def commit(self, tmp: Path, dst: Path, receipts: list[UnitReceipt]) -> Path:
        """Check every shard is there at its planned size, write the index and ``config.json``, rename."""
        check_cover(receipts, len(self.shards), str(dst))
        sizes = {name: size for r in receipts for name, size in r.data.items()}
        for k, shard in enumerate(self.shards):
            fname = self.names[k]
            want = len(_header(shard)) + self.weights[k]
            path = tmp / fname
            if sizes.get(fname) != want or not path.is_file() or path.stat().st_size != want:
                raise CorruptionError(f"{dst}: shard {fname} is not the {want} bytes planned")
        weight_map = {info.name: self.names[k] for k, shard in enumerate(self.shards) for info in shard}
        index = {"metadata": {"total_size": sum(self.weights)}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        config = dict(self.conv.config or {})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        publish_dir(tmp, dst)
        return dst

    def abort(self, tmp: Path) -> None:
        remove_dir(tmp)


def write_hf(
    conv: Conversion,
    dst: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write the model tensors of ``conv`` (CUDA layout) as a Hugging Face folder at ``dst`` (atomically).

    One process; ``ckpt convert --workers N`` and torchrun run the same :class:`HFExport` with the shard files
    spread over the workers, so the files are the same.
    """
    return write_serial(HFExport(conv, max_shard_bytes=max_shard_bytes), dst, progress)


__all__ = [
    "HFExport",
    "HFSource",
    "is_hf_dir",
    "open_hf",
    "read_header",
    "shard_plan",
    "write_hf",
    "dtype_name",
]
