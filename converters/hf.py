"""Hugging Face checkpoints: a folder with ``config.json`` and ``model*.safetensors`` (+ index).

Source (:class:`HFSource`): a CUDA-layout source over the safetensors files; a piece is read as a slice of the
memory-mapped file (``safe_open(...).get_slice``), so importing into our manifest or straight into the Neuron TP/PP
layout (to start a fine-tune on Trainium) reads each byte once and holds no more than a part at a time.

Target (:class:`HFExport`): sharded ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` +
``config.json``, loadable with ``transformers.AutoModelForCausalLM.from_pretrained``.  A shard's safetensors header
is computed from the plan before any data is read, then tensors are streamed in one at a time.  Units are whole
shard files (any worker can write any of them); the index and ``config.json`` are the commit, published with the
folder (:func:`ckpt.storage.folder.begin_folder`: a temp folder and a rename on disk, markers last on object
stores).  Optimizer state has no place in this format and is not written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CkptError, CorruptionError, LayoutError
from ckpt.format.datafile import safetensors_header, tensor_bytes
from ckpt.format.dtypes import dtype_from_name
from ckpt.format.manifest import TensorDesc
from ckpt.layouts import Piece
from ckpt.storage import open_storage
from ckpt.words import count

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
from .folder_export import FolderExport, write_all
from .hf_index import INDEX_NAME, SINGLE_NAME, hf_tensors, read_header, read_json

NAME = "hf"
DEFAULT_SHARD_BYTES = 5 << 30


def detect(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and ((p / INDEX_NAME).is_file() or (p / SINGLE_NAME).is_file())


class HFSource(Source):
    """A Hugging Face model folder as a CUDA-layout source (parameters only; step from ``--step`` or 0)."""

    format = NAME
    layout = "cuda"

    def __init__(self, path: str | Path, *, config: Mapping[str, Any] | None = None, step: int = 0) -> None:
        root = Path(path)
        self.path = str(root)
        if not detect(str(root)):
            raise CkptError(f"{root}: not a Hugging Face model folder (config.json + model*.safetensors)")
        if config is None:
            config = read_json(root / "config.json", "config.json")
            if not isinstance(config, dict):
                raise CorruptionError(f"{root / 'config.json'}: expected a JSON object")
        self.config = dict(config)
        # the index held against the shard headers (one line and exit 1 when they disagree)
        found = hf_tensors(root)
        self._file_of: dict[str, Path] = {name: t.file for name, t in found.items()}
        self.tensors = {
            name: TensorDesc(name, "parameter", tuple(t.entry["shape"]), t.entry["dtype"]) for name, t in found.items()
        }
        self.trees = Trees(step=step, progress={"step": step}, extra={"config": self.config})
        self.step_recorded = False  # an HF model folder has no step (a Trainer checkpoint sets it below)
        self._handles: dict[Path, Any] = {}

    def read(self, piece: Piece) -> torch.Tensor:
        from safetensors import safe_open

        fpath = self._file_of[piece.name]
        try:
            h = self._handles.get(fpath)
            if h is None:
                h = self._handles[fpath] = safe_open(str(fpath), framework="pt")
            if piece.dim is None:
                return h.get_tensor(piece.name)
            if piece.dim == 0:
                return h.get_slice(piece.name)[piece.start : piece.start + piece.length]
            return slice_of(h.get_tensor(piece.name), piece)
        except Exception as e:  # noqa: BLE001 - safetensors' own error about a damaged file, as one line
            if isinstance(e, CkptError):
                raise
            raise CorruptionError(f"{fpath}: tensor {piece.name!r}: unreadable ({e})") from None

    def read_anon(self, piece: Piece) -> int:
        """Whole tensors and column slices are views of the memory-mapped file; ``get_slice`` copies its rows."""
        return self.piece_bytes(piece) if piece.dim == 0 else 0

    def close(self) -> None:
        self._handles.clear()


def open_source(
    path: str, *, config: Mapping[str, Any] | None = None, step: int | None = None, **_: Any
) -> HFSource:
    return HFSource(path, config=config, step=step or 0)


def shard_plan(descs: list[TensorDesc], max_shard_bytes: int) -> list[list[TensorDesc]]:
    """Tensors grouped into shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[TensorDesc]] = [[]]
    size = 0
    for d in descs:
        if shards[-1] and size + d.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(d)
        size += d.nbytes
    return [s for s in shards if s]


def _header(shard: list[TensorDesc]) -> bytes:
    return safetensors_header([(d.name, d.dtype, d.shape, d.nbytes) for d in shard], {"format": "pt"})


def check_export(conv: Conversion) -> None:
    """Fail before any work when the export cannot produce a loadable folder."""
    if conv.to != "cuda":
        raise LayoutError("--format hf holds the CUDA layout (full tensors); use --to cuda")
    if not conv.config:
        raise LayoutError("Hugging Face export needs the model config; pass --config config.json")


#: why an HF folder leaves state out (said with the list of what was left out)
NOT_WRITTEN_WHY = "a Hugging Face folder holds model weights and config.json only"


def not_written(conv: Conversion, kept: Mapping[str, Any], holds: frozenset[str] = frozenset()) -> list[str]:
    """What of ``conv`` an HF folder does not hold, as phrases (empty when nothing is left out); ``holds`` names
    the non-tensor state (phrases below) a richer folder does write, e.g. an HF Trainer checkpoint's scheduler."""
    left: dict[str, int] = {}
    for t in conv.tensors:
        if t.desc.name not in kept:
            left[t.desc.role] = left.get(t.desc.role, 0) + 1
    out = [count(n, f"{role.replace('_', '-')} tensor") for role, n in sorted(left.items())]
    trees = conv.trees
    for what, value in (
        ("optimizer param groups", trees.optimizer if not left else None),
        ("scheduler state", trees.scheduler),
        ("GradScaler state", trees.scaler),
        ("RNG state", trees.rng),
        ("data-loader state", trees.data),
        ("user metadata", trees.user),
    ):
        if value and what not in holds:
            out.append(what)
    acc = trees.extra.get("accelerate") if isinstance(trees.extra, Mapping) else None
    if isinstance(acc, Mapping) and acc.get("sampler") is not None and "accelerate sampler" not in holds:
        out.append("accelerate sampler")  # sampler.bin (extra.accelerate.sampler): only an accelerate folder has one
    return out


def shard_file_name(k: int, n: int) -> str:
    """HF's name for shard ``k`` (0-based) of ``n``."""
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


class HFExport(FolderExport):
    """An HF folder as an :class:`~converters.engine.Export`: one unit = one whole shard file."""

    def __init__(
        self,
        conv: Conversion,
        *,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
    ) -> None:
        check_export(conv)
        self.conv = conv
        self.storage_options = storage_options
        self.verify = verify
        self.outs = {t.desc.name: t for t in conv.tensors if t.desc.role in MODEL_ROLES}
        #: the planned tensors this format writes, and what it leaves out (said in the summary, never silently)
        self.kept = tuple(self.outs)
        self.not_written = not_written(conv, self.outs)
        self.shards = shard_plan([t.desc for t in self.outs.values()], max_shard_bytes)
        self.names = [shard_file_name(k, len(self.shards)) for k in range(len(self.shards))]
        self.weights = [sum(d.nbytes for d in shard) for shard in self.shards]

    def write(
        self, staging: Staging, units: Sequence[int], progress: Progress = None, *, worker: int = 0
    ) -> UnitReceipt:
        """Write shard files ``units`` (header from the plan, then tensors streamed one at a time)."""
        storage = open_storage(staging.url, self.storage_options)
        sizes: dict[str, int] = {}
        for k in units:
            shard, fname = self.shards[k], self.names[k]
            with storage.create(fname) as f:
                size = f.write(_header(shard))
                for d in shard:
                    (part,) = self.outs[d.name].parts
                    data = produce(self.conv, part, verify=self.verify).contiguous()
                    if data.dtype != dtype_from_name(d.dtype) or tuple(data.shape) != d.shape:
                        raise CorruptionError(f"{d.name}: produced {list(data.shape)} {data.dtype}")
                    size += write_all(f, tensor_bytes(data))
                    if progress is not None:
                        progress(d.nbytes)
            sizes[fname] = size
        return UnitReceipt(worker, tuple(units), sizes)

    def unit_parts(self, unit: int) -> list[OutPart]:
        """The parts shard ``unit`` is made of (what torchrun ranks plan their reads by)."""
        return [self.outs[d.name].parts[0] for d in self.shards[unit]]

    def commit(self, staging: Staging, dst: str, receipts: list[UnitReceipt]) -> str:
        """Check every shard is there at its planned size, then publish with the index and ``config.json``."""
        check_cover(receipts, len(self.shards), dst)
        txn = self.begun(staging, dst)
        sizes = {name: size for r in receipts for name, size in r.data.items()}
        storage = txn.storage
        for k, shard in enumerate(self.shards):
            fname = self.names[k]
            want = len(_header(shard)) + self.weights[k]
            if sizes.get(fname) != want or storage.size(fname) != want:
                raise CorruptionError(f"{dst}: shard {fname} is not the {want} bytes planned")
        weight_map = {d.name: self.names[k] for k, shard in enumerate(self.shards) for d in shard}
        index = {"metadata": {"total_size": sum(self.weights)}, "weight_map": weight_map}
        config = dict(self.conv.config or {})
        storage.put_bytes("config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
        txn.commit({INDEX_NAME: (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()})
        return dst


def export(conv: Conversion, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES, storage_options: dict[str, Any] | None = None,
           verify: bool = True, **_: Any) -> HFExport:  # fmt: skip
    return HFExport(conv, max_shard_bytes=max_shard_bytes, storage_options=storage_options, verify=verify)


__all__ = ["HFExport", "HFSource", "detect", "export", "open_source", "read_header", "shard_plan"]
