"""accelerate ``Accelerator.save_state`` folders as a conversion source and target (``--format accelerate``).

What the files hold is in :mod:`.accelerate_files`.  Source (:class:`AccelerateSource`): the models' tensors (model
``i`` > 0 prefixed ``model_{i}.``), the optimizer moments as ``optim/<param>/<key>`` tensors (read memory-mapped)
with ``param_groups`` and per-parameter scalars in the optimizer tree, the scheduler, the ``GradScaler``, the
``StatefulDataLoader`` state as rank 0's data-loader state (accelerate writes one ``dl_state_dict.bin`` for all
processes), each process's RNG streams, and in ``extra.accelerate`` what has no place of its own: accelerate's
``step`` counter per process, the ``custom_checkpoint_{i}.pkl`` state dicts and the ``sampler.bin`` sampler
(:mod:`.accelerate_sampler`: seed, epoch, generator, data source; its epoch also as ``progress.epoch``).  A
save_state folder records no training step (``checkpoint_{n}`` counts saves): the step is unknown.

Target (:class:`AccelerateExport`): one unit per model file (``model.safetensors``, ``model_1.safetensors``: a
safetensors header from the plan, then tensors streamed one at a time) and one for ``optimizer.bin`` (numbered in
``param_groups`` order, which is the order the source's numbers named them in); the other files at the commit,
``random_states_*.pkl`` last (``sampler.bin`` as accelerate pickles it, when the source had one).
``Accelerator.load_state`` on the folder restores the model, optimizer, scheduler, scaler, data-loader and RNG state
exactly (the sampler too, once its classes are allow-listed: see :mod:`.accelerate_sampler`).  Only one optimizer
/ scheduler / data loader is converted (their ``_1`` files cannot be paired with a model's parameters): a folder
with more is refused, never half-read.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CkptError, CorruptionError, LayoutError
from ckpt.format import treecodec
from ckpt.format.datafile import safetensors_header, tensor_bytes
from ckpt.format.dtypes import dtype_from_name, dtype_name
from ckpt.format.manifest import MANIFEST_NAME, TensorDesc
from ckpt.layouts import Piece
from ckpt.storage import open_storage

from . import accelerate_files as af
from .accelerate_sampler import encode as encode_sampler
from .accelerate_sampler import read_sampler, sampler_bytes
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
)
from .engine.export import Progress
from .folder_export import FolderExport, write_all
from .hf import not_written
from .hf_index import read_header

NAME = "accelerate"
_PREFIX = re.compile(r"model_(\d+)\.(.+)")
#: the state a save_state folder holds besides tensors (phrases of :func:`.hf.not_written`)
HOLDS = frozenset(
    {"optimizer param groups", "scheduler state", "GradScaler state", "RNG state", "data-loader state",
     "accelerate sampler"}
)


def detect(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """A local folder with a file only ``save_state`` writes (``random_states_0.pkl``, ``optimizer.bin``, ...) and
    no manifest of ours."""
    p = Path(path)
    if not p.is_dir() or (p / MANIFEST_NAME).exists():
        return False
    try:
        return any(af.is_state_file(n) for n in os.listdir(p))
    except OSError:
        return False


def _only_first(names: Sequence[str], base: str, ext: str, where: Path) -> str | None:
    """``base.ext`` when present; a folder that also holds ``base_1.ext`` (a second object) is refused."""
    more = sorted(n for n in names if re.fullmatch(rf"{base}_\d+\.{ext}", n))
    if more:
        raise CkptError(
            f"{where}: holds {more[0]}: ckpt converts one {base.replace('_', ' ')} ({base}.{ext}), and cannot tell "
            "which model's parameters a second one steps"
        )
    return f"{base}.{ext}" if f"{base}.{ext}" in names else None


class AccelerateSource(Source):
    """A save_state folder: models, optimizer moments and the training state (see the module docstring)."""

    format = NAME
    layout = "cuda"
    title = "accelerate save_state"
    step_recorded = False

    def __init__(self, path: str | Path, *, config: Mapping[str, Any] | None = None) -> None:
        root = Path(path)
        self.path = str(root)
        if not detect(str(root)):
            raise CkptError(
                f"{root}: not an accelerate save_state folder (random_states_0.pkl, optimizer.bin, ...)"
            )
        names = sorted(os.listdir(root))
        if config is None and "config.json" in names:  # saved beside the state by the user (save_pretrained)
            from .hf_index import read_json

            config = read_json(root / "config.json", "config.json")
        self.config = dict(config) if config else None
        files = af.model_files(names, str(root))
        self.tensors: dict[str, TensorDesc] = {}
        self._where: dict[str, tuple[Path, str]] = {}  # our name -> (file, its name there)
        self._bins: dict[Path, dict[str, torch.Tensor]] = {}
        self._handles: dict[Path, Any] = {}
        self._model: Any = None  # the ckpt step holding the model (a folder of ckpt.integrations.accelerate)
        if not files and af.POINTER in names:
            self._model = af.pointed_model(root)
            self.tensors.update(self._model.tensors)
        elif not files:
            raise CkptError(
                f"{root}: no model.safetensors or pytorch_model.bin (an FSDP or DeepSpeed save_state folder is not "
                "read)"
            )
        for i, fname in enumerate(files):
            self._read_model(root / fname, "" if i == 0 else f"model_{i}.")
        self.safe = not files or files[0].endswith(".safetensors")
        self.trees = Trees(step=0, progress={"step": 0}, extra={})
        self._moments: dict[str, tuple[int, str]] = {}
        self._opt: Any = None
        opt = _only_first(names, "optimizer", "bin", root)
        if opt is not None:
            self._read_optimizer(root / opt)
        sched = _only_first(names, "scheduler", "bin", root)
        if sched is not None:
            self.trees.scheduler = treecodec.encode(af.load(root / sched), "scheduler")
        dl = _only_first(names, "dl_state_dict", "bin", root)
        if dl is not None:
            self.trees.data = {"0": treecodec.encode(af.load(root / dl), "data")}
        sampler = None
        if _only_first(names, "sampler", "bin", root) is not None:  # a pickled sampler, read as data
            sampler = read_sampler(root / af.SAMPLER)
            self.trees.progress["epoch"] = sampler["epoch"]
        if af.SCALER in names:
            self.trees.scaler = treecodec.encode(af.load(root / af.SCALER), "scaler")
        self.trees.rng, steps = af.read_rng(root, names)
        self.trees.world_size = max(1, len(self.trees.rng))
        record: dict[str, Any] = {"step": steps, "safe_serialization": self.safe}
        custom = af.custom_states(root, names)
        if custom:
            record["custom"] = custom
        if sampler is not None:
            record["sampler"] = encode_sampler(sampler)
        self.trees.extra["accelerate"] = record
        if self.config:
            self.trees.extra["config"] = self.config

    def _read_model(self, path: Path, prefix: str) -> None:
        if path.suffix == ".safetensors":
            for name, entry in read_header(path).items():
                if name != "__metadata__":
                    self._add(prefix + name, tuple(entry["shape"]), entry["dtype"], path, name)
            return
        sd = af.load(path, mmap=True)
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise CkptError(f"{path}: not a model state dict (name -> tensor)")
        self._bins[path] = sd
        for name, t in sd.items():
            self._add(prefix + name, tuple(t.shape), dtype_name(t.dtype), path, name)

    def _add(self, name: str, shape: tuple[int, ...], dtype: str, path: Path, inner: str) -> None:
        if name in self.tensors:
            raise CkptError(f"{path}: tensor {name!r} is also in another model file")
        self.tensors[name] = TensorDesc(name, "parameter", shape, dtype)
        self._where[name] = (path, inner)

    def _read_optimizer(self, path: Path) -> None:
        opt = af.load(path, mmap=True)
        order = af.model_order(self.config, str(path)) if self.config else None
        shapes = {n: d.shape for n, d in self.tensors.items()}
        named = af.name_optimizer_params(path, opt, shapes, order)
        scalars: dict[str, dict[str, Any]] = {}
        for idx, per in opt["state"].items():
            name = named[idx]
            for key, value in per.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    tname = f"optim/{name}/{key}"
                    self.tensors[tname] = TensorDesc(
                        tname, "optimizer_state", tuple(value.shape), dtype_name(value.dtype), name, key
                    )
                    self._moments[tname] = (idx, key)
                else:
                    scalars.setdefault(name, {})[key] = value
        self._opt = opt
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [named[i] for i in g["params"]]}
                  for g in opt["param_groups"]]  # fmt: skip
        tree = {"type": None, "param_groups": groups, "state": scalars}
        self.trees.optimizer = treecodec.encode(tree, "optimizer")

    def read(self, piece: Piece) -> torch.Tensor:
        hit = self._moments.get(piece.name)
        if hit is None and self._model is not None:
            return self._model.read(piece)
        if hit is not None:
            t = self._opt["state"][hit[0]][hit[1]]
        else:
            path, inner = self._where[piece.name]
            t = self._bins[path][inner] if path in self._bins else self._safetensor(path, inner)
        return t if piece.dim is None else t.narrow(piece.dim, piece.start, piece.length)

    def _safetensor(self, path: Path, name: str) -> torch.Tensor:
        from safetensors import safe_open

        try:
            h = self._handles.get(path)
            if h is None:
                h = self._handles[path] = safe_open(str(path), framework="pt")
            return h.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - safetensors' own error about a damaged file, as one line
            raise CorruptionError(f"{path}: tensor {name!r}: unreadable ({e})") from None

    def close(self) -> None:
        if self._model is not None:
            self._model.close()
        self._handles.clear()
        self._bins.clear()
        self._opt = None


def open_source(path: str, *, config: Mapping[str, Any] | None = None, **_: Any) -> AccelerateSource:
    return AccelerateSource(path, config=config)


def _bytes_of(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _model_index(name: str) -> tuple[int, str]:
    m = _PREFIX.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else (0, name)


class AccelerateExport(FolderExport):
    """A save_state folder: one unit per model file, then ``optimizer.bin``; the rest at the commit."""

    def __init__(
        self, conv: Conversion, *, storage_options: dict[str, Any] | None = None, verify: bool = True
    ) -> None:
        if conv.to != "cuda":
            raise LayoutError("--format accelerate holds the CUDA layout (full tensors); use --to cuda")
        self.conv = conv
        self.storage_options = storage_options
        self.verify = verify
        outs = {t.desc.name: t for t in conv.tensors if t.desc.role in MODEL_ROLES}
        by_file: dict[int, list[Any]] = {}
        for name, t in outs.items():
            by_file.setdefault(_model_index(name)[0], []).append(t)
        if sorted(by_file) != list(range(len(by_file))):
            raise LayoutError(
                f"--format accelerate: model tensors for models {sorted(by_file)} skip an index"
            )
        self.files = [by_file[i] for i in range(len(by_file))]
        record = conv.trees.extra.get("accelerate") or {}
        self.names = [
            af.model_file_name(i, bool(record.get("safe_serialization", True)))
            for i in range(len(self.files))
        ]
        self.moments = {t.desc.name: t for t in conv.tensors if t.desc.role == "optimizer_state"}
        self.optimizer = treecodec.decode(conv.trees.optimizer) if conv.trees.optimizer else None
        if self.optimizer is not None:
            listed = [n for g in self.optimizer.get("param_groups", []) for n in g["params"]]
            unknown = sorted(set(listed) - set(outs))
            if unknown:
                raise LayoutError(
                    f"--format accelerate: param_groups name tensors the model lacks ({', '.join(unknown[:3])})"
                )
        self.weights = [sum(t.desc.nbytes for t in f) or 1 for f in self.files]
        if self.optimizer is not None:
            self.weights.append(sum(t.desc.nbytes for t in self.moments.values()) or 1)
        kept = {**outs, **(self.moments if self.optimizer is not None else {})}
        self.kept = tuple(kept)
        self.not_written = not_written(conv, kept, HOLDS)

    def _header(self, k: int) -> bytes:
        _, inner = zip(*(_model_index(t.desc.name) for t in self.files[k]), strict=True)
        return safetensors_header(
            [
                (n, t.desc.dtype, t.desc.shape, t.desc.nbytes)
                for n, t in zip(inner, self.files[k], strict=True)
            ],
            {"format": "pt"},
        )

    def write(
        self, staging: Staging, units: Sequence[int], progress: Progress = None, *, worker: int = 0
    ) -> UnitReceipt:
        storage = open_storage(staging.url, self.storage_options)
        sizes: dict[str, int] = {}
        for k in units:
            if k == len(self.files):
                data = _bytes_of(self._optimizer_state(progress))
                storage.put_bytes(af.OPTIMIZER, data)
                sizes[af.OPTIMIZER] = len(data)
                continue
            fname = self.names[k]
            if fname.endswith(".bin"):
                state = {_model_index(t.desc.name)[1]: self._produce(t, progress) for t in self.files[k]}
                data = _bytes_of(state)
                storage.put_bytes(fname, data)
                sizes[fname] = len(data)
                continue
            with storage.create(fname) as f:
                size = f.write(self._header(k))
                for t in self.files[k]:
                    size += write_all(f, tensor_bytes(self._produce(t, progress)))
            sizes[fname] = size
        return UnitReceipt(worker, tuple(units), sizes)

    def _produce(self, t: Any, progress: Progress) -> torch.Tensor:
        (part,) = t.parts
        data = produce(self.conv, part, verify=self.verify).contiguous()
        if data.dtype != dtype_from_name(t.desc.dtype) or tuple(data.shape) != t.desc.shape:
            raise CorruptionError(f"{t.desc.name}: produced {list(data.shape)} {data.dtype}")
        if progress is not None:
            progress(t.desc.nbytes)
        return data

    def unit_parts(self, unit: int) -> list[OutPart]:
        if unit == len(self.files):
            return [t.parts[0] for t in self.moments.values()]
        return [t.parts[0] for t in self.files[unit]]

    def _optimizer_state(self, progress: Progress) -> dict[str, Any]:
        """The optimizer state dict, parameters numbered in ``param_groups`` order."""
        assert self.optimizer is not None
        scalars = self.optimizer.get("state", {})
        moments: dict[str, list[Any]] = {}
        for t in self.moments.values():
            moments.setdefault(str(t.desc.param), []).append(t)
        state: dict[int, dict[str, Any]] = {}
        groups = []
        i = 0
        for g in self.optimizer["param_groups"]:
            ids = []
            for name in g["params"]:
                per = dict(scalars.get(name, {}))
                for t in moments.get(name, ()):
                    per[t.desc.key] = self._produce(t, progress).clone()
                if per:
                    state[i] = per
                ids.append(i)
                i += 1
            groups.append({**g, "params": ids})
        return {"state": state, "param_groups": groups}

    def commit(self, staging: Staging, dst: str, receipts: list[UnitReceipt]) -> str:
        check_cover(receipts, len(self.weights), dst)
        txn = self.begun(staging, dst)
        storage = txn.storage
        trees = self.conv.trees
        for k, fname in enumerate(self.names):
            if fname.endswith(".safetensors"):
                want = len(self._header(k)) + sum(t.desc.nbytes for t in self.files[k])
                if storage.size(fname) != want:
                    raise CorruptionError(f"{dst}: {fname} is not the {want} bytes planned")
        for name, tree in ((af.SCHEDULER, trees.scheduler), (af.SCALER, trees.scaler)):
            if tree is not None:
                storage.put_bytes(name, _bytes_of(treecodec.decode(tree)))
        data = trees.data or {}
        if len(data) > 1 and len({repr(v) for v in data.values()}) > 1:
            raise LayoutError(
                f"--format accelerate: {len(data)} ranks' data-loader states differ; save_state keeps one "
                "dl_state_dict.bin for all processes"
            )
        if data:
            storage.put_bytes(af.DL_STATE, _bytes_of(treecodec.decode(next(iter(data.values())))))
        record = trees.extra.get("accelerate") or {}
        if record.get("sampler") is not None:
            storage.put_bytes(af.SAMPLER, sampler_bytes(record["sampler"]))
        for idx, tree in sorted((record.get("custom") or {}).items()):
            storage.put_bytes(f"custom_checkpoint_{idx}.pkl", _bytes_of(treecodec.decode(tree)))
        rng = af.rng_files(trees.rng or {}, record.get("step") or {}, trees.step)
        txn.commit({name: _bytes_of(st) for name, st in rng.items()})
        return dst


def export(
    conv: Conversion, *, storage_options: dict[str, Any] | None = None, verify: bool = True, **_: Any
) -> AccelerateExport:
    return AccelerateExport(conv, storage_options=storage_options, verify=verify)


__all__ = ["AccelerateExport", "AccelerateSource", "detect", "export", "open_source"]
