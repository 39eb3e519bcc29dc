"""Hugging Face ``Trainer`` checkpoint folders (``checkpoint-N/``) as a conversion source and target.

A Trainer checkpoint is the model (``model.safetensors`` or shards + index, ``config.json``), ``optimizer.pt``
(``torch.optim`` state dict: parameters are *numbered*), ``scheduler.pt``, ``rng_state.pth`` (``python``,
``numpy``, ``cpu``, ``cuda``) and ``trainer_state.json`` (``global_step``, ``log_history``, ...).

The parameter numbering is the one fact the files do not say: ``Trainer.create_optimizer`` puts the model's
parameters, in ``named_parameters()`` order, into two groups, those with weight decay
(``Trainer.get_decay_parameter_names``) then the rest, and numbers them in that order.  Both directions rebuild
that order from the model config (the model is built on the ``meta`` device: no memory, no weights) and refuse
a checkpoint whose group sizes or tensor shapes do not fit it, rather than guess.

Source (:class:`TrainerSource`): the model as in :mod:`.hf`; the optimizer moments as ``optim/<param>/<key>``
tensors (read memory-mapped, one at a time), per-parameter scalars (``step``), ``param_groups``, the scheduler
and the RNG streams into the checkpoint's trees; ``trainer_state.json`` rides along in
``extra.hf_trainer_state``.  The ``.pt`` files are read with :func:`ckpt.safe_unpickle.load_torch_file`
(weights_only + allow-list: NumPy's RNG state is the only addition), never with plain pickle.

Target (:class:`TrainerExport`): the model shards of :class:`.hf.HFExport` plus one more unit, ``optimizer.pt``
in the Trainer's numbering and two groups (a source group split in two keeps its hyper-parameters, so the
continuation is exact; two source groups with different hyper-parameters that the Trainer would put in one
group are refused); ``scheduler.pt``, ``rng_state.pth`` and ``trainer_state.json`` are written at the commit,
before the index that publishes the folder.  ``optimizer.pt`` is built in memory (one tensor of the model at a
time is read, the whole state is held for ``torch.save``).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckpt.errors import CkptError, LayoutError
from ckpt.format import treecodec
from ckpt.format.dtypes import dtype_name
from ckpt.format.manifest import TensorDesc
from ckpt.layouts import Piece
from ckpt.safe_unpickle import load_torch_file
from ckpt.storage import open_storage

from .engine import Conversion, OutPart, Staging, UnitReceipt, check_cover, produce
from .engine.export import Progress
from .hf import DEFAULT_SHARD_BYTES, HFExport, HFSource, not_written
from .hf import detect as detect_hf

NAME = "hf-trainer"
STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
#: why a Trainer checkpoint leaves state out (said with the list of what was left out)
NOT_WRITTEN_WHY = "an HF Trainer checkpoint holds the model, optimizer.pt, scheduler.pt, rng_state*.pth and trainer_state.json only"
SCHEDULER_NAME = "scheduler.pt"
RNG_NAME = "rng_state.pth"

_np_core = getattr(np, "_core", None) or np.core  # numpy 2 moved numpy.core to numpy._core
#: globals NumPy's RNG state needs in ``rng_state.pth`` (the Trainer's own ``safe_globals`` list), under the
#: module names either NumPy major version pickles them with
_NUMPY_ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy._core.multiarray", "_reconstruct"): _np_core.multiarray._reconstruct,
    ("numpy.core.multiarray", "_reconstruct"): _np_core.multiarray._reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}
if hasattr(np, "dtypes"):  # numpy >= 1.25 pickles the dtype's class
    _NUMPY_ALLOWED[("numpy.dtypes", "UInt32DType")] = np.dtypes.UInt32DType


def detect(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    return detect_hf(path) and (Path(path) / STATE_NAME).is_file()


def read_rng_files(root: Path) -> dict[str, Any]:
    """The Trainer's ``rng_state.pth`` / ``rng_state_{rank}.pth`` files under ``root`` as our RNG trees, by rank.

    ``cpu`` is stored as ``torch``; ``cuda`` and torch_xla's ``xla`` seed (what a Trainer on XLA adds) are kept."""
    out: dict[str, Any] = {}
    for f in sorted(root.glob("rng_state*.pth")):
        rank = f.stem.rpartition("_")[2] if f.stem != "rng_state" else "0"
        st = load_torch_file(f, _NUMPY_ALLOWED)
        rec = {"python": st.get("python"), "numpy": st.get("numpy"), "torch": st.get("cpu")}
        for key in ("cuda", "xla"):
            if st.get(key) is not None:
                rec[key] = st[key]
        out[rank if rank.isdigit() else "0"] = treecodec.encode(rec, f"rng.{f.name}")
    return out


def rng_file_states(rng: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Inverse of :func:`read_rng_files`: ``{file name: state dict as the Trainer saves it}``."""
    out = {}
    for rank, rec in sorted(rng.items()):
        r = treecodec.decode(rec)
        st = {"python": r.get("python"), "numpy": r.get("numpy"), "cpu": r.get("torch")}
        for key in ("cuda", "xla"):
            if r.get(key) is not None:
                st[key] = r[key]
        out[RNG_NAME if len(rng) == 1 else f"rng_state_{rank}.pth"] = st
    return out


def trainer_param_groups(config: Mapping[str, Any], where: str) -> tuple[list[str], list[str]]:
    """(decay, no-decay) parameter names in the order ``Trainer.create_optimizer`` numbers them."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, Trainer
    except ImportError:
        raise CkptError("--format hf-trainer needs transformers: pip install 'ckpt[hf]'") from None
    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise LayoutError(
            f"{where}: config.json has no model_type; cannot rebuild the Trainer's parameter order"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    decay = set(Trainer.get_decay_parameter_names(None, model))  # self is unused
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return [n for n in names if n in decay], [n for n in names if n not in decay]


def trainer_groups(
    optimizer: Mapping[str, Any], decay: list[str], rest: list[str], where: str
) -> list[dict[str, Any]]:
    """The Trainer's two param groups (``decay`` then ``rest`` names), each with the hyper-parameters of the one
    source group its params come from; parameters the Trainer puts in one group that come from source groups with
    different hyper-parameters are refused (the continuation would not be exact)."""
    group_of = {n: g for g in optimizer.get("param_groups", []) for n in g["params"]}
    out = []
    for label, names in (("with", decay), ("without", rest)):
        hypers = {
            json.dumps(treecodec.encode({k: v for k, v in group_of[n].items() if k != "params"}), sort_keys=True)
            for n in names
            if n in group_of
        }
        if len(hypers) > 1:
            raise LayoutError(
                f"{where}: the parameters the Trainer puts in one group ({label} weight decay) come from source "
                "param_groups with different hyper-parameters; the Trainer cannot hold them"
            )
        if hypers:
            hyper = treecodec.decode(json.loads(hypers.pop()))
        else:  # an empty group: the Trainer still creates it
            first = optimizer["param_groups"][0]
            hyper = {k: v for k, v in first.items() if k != "params"}
            hyper["weight_decay"] = 0.0 if label == "without" else hyper.get("weight_decay", 0.0)
        out.append({**hyper, "params": names})
    return out


class TrainerSource(HFSource):
    """A ``checkpoint-N`` folder: model, optimizer moments and the training state (see the module docstring)."""

    format = NAME

    def __init__(self, path: str | Path, *, config: Mapping[str, Any] | None = None) -> None:
        root = Path(path)
        super().__init__(root, config=config)
        state_file = root / STATE_NAME
        try:
            state = json.loads(state_file.read_text())
            step = int(state["global_step"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CkptError(f"{state_file}: not a Trainer state ({type(exc).__name__}: {exc})") from None
        self.trees.step = step
        self.trees.progress = {"step": step}
        self.step_recorded = True
        self.trees.extra = {"config": self.config, "hf_trainer_state": state}
        self._moments: dict[str, tuple[str, int, str]] = {}
        self._opt: Any = None
        if (root / OPTIMIZER_NAME).is_file():
            self._read_optimizer(root / OPTIMIZER_NAME)
        if (root / SCHEDULER_NAME).is_file():
            self.trees.scheduler = treecodec.encode(load_torch_file(root / SCHEDULER_NAME), "scheduler")
        self.trees.rng.update(read_rng_files(root))

    def _read_optimizer(self, path: Path) -> None:
        opt = load_torch_file(path, mmap=True)
        wanted = trainer_param_groups(self.config, str(path))
        shapes = {n: tuple(t.shape) for n, t in self.tensors.items()}
        scalars: dict[str, dict[str, Any]] = {}
        for idx, name, per in named_optimizer_state(path, opt, wanted, shapes, "model"):
            shape = self.tensors[name].shape
            for key, value in per.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    tname = f"optim/{name}/{key}"
                    self.tensors[tname] = TensorDesc(
                        tname, "optimizer_state", shape, dtype_name(value.dtype), name, key
                    )
                    self._moments[tname] = (name, idx, key)
                else:
                    scalars.setdefault(name, {})[key] = value
        self._opt = opt
        pg = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": names}
            for g, names in zip(opt["param_groups"], wanted, strict=True)
        ]
        tree = {"type": "torch.optim.adamw.AdamW", "param_groups": pg, "state": scalars}
        self.trees.optimizer = treecodec.encode(tree, "optimizer")

    def read(self, piece: Piece) -> torch.Tensor:
        hit = self._moments.get(piece.name)
        if hit is None:
            return super().read(piece)
        _, idx, key = hit
        t = self._opt["state"][idx][key]
        if piece.dim is None:
            return t
        return t.narrow(piece.dim, piece.start, piece.length)

    def close(self) -> None:
        super().close()
        self._opt = None


def open_source(path: str, *, config: Mapping[str, Any] | None = None, **_: Any) -> TrainerSource:
    return TrainerSource(path, config=config)


def _bytes_of(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class TrainerExport(HFExport):
    """A ``checkpoint-N`` folder: the model shards, then ``optimizer.pt`` as one more unit; the rest at commit."""

    def __init__(self, conv: Conversion, **kw: Any) -> None:
        super().__init__(conv, **kw)
        where = "--format hf-trainer"
        self.decay, self.rest = trainer_param_groups(conv.config or {}, where)
        model = {t.desc.name for t in self.outs.values()}
        if set(self.decay + self.rest) - model:
            missing = sorted(set(self.decay + self.rest) - model)
            raise LayoutError(
                f"{where}: the model config has parameters the checkpoint lacks ({', '.join(missing[:3])})"
            )
        # a data position the folder cannot hold is refused before anything is written
        trainer_data_position(
            conv.trees.data_position, conv.trees.step, conv.trees.extra.get("hf_trainer_state") or {}
        )
        self.moments = {t.desc.name: t for t in conv.tensors if t.desc.role == "optimizer_state"}
        self.optimizer = treecodec.decode(conv.trees.optimizer) if conv.trees.optimizer else None
        self.groups = self._regroup() if self.optimizer else None
        if self.groups is not None:  # one more unit: optimizer.pt
            self.weights = [*self.weights, sum(t.desc.nbytes for t in self.moments.values()) or 1]
        kept = {**self.outs, **(self.moments if self.groups is not None else {})}
        self.kept = tuple(kept)  # what the summary counts: the model and, in optimizer.pt, its moments
        holds = {"scheduler state", "RNG state"} | (
            {"optimizer param groups"} if self.groups is not None else set()
        )
        self.not_written = not_written(conv, kept, frozenset(holds))

    def _regroup(self) -> list[dict[str, Any]]:
        assert self.optimizer is not None
        return trainer_groups(self.optimizer, self.decay, self.rest, "--format hf-trainer")

    def write(
        self, staging: Staging, units: Sequence[int], progress: Progress = None, *, worker: int = 0
    ) -> UnitReceipt:
        model_units = [k for k in units if k < len(self.shards)]
        receipt = super().write(staging, model_units, progress, worker=worker)
        sizes = dict(receipt.data)
        if len(self.shards) in units and self.groups is not None:
            data = _bytes_of(self._optimizer_state(progress))
            open_storage(staging.url, self.storage_options).put_bytes(OPTIMIZER_NAME, data)
            sizes[OPTIMIZER_NAME] = len(data)
        return UnitReceipt(worker, tuple(units), sizes)

    def unit_parts(self, unit: int) -> list[OutPart]:
        """A shard's parts, or (the last unit) the moments ``optimizer.pt`` holds."""
        if unit == len(self.shards):
            return [t.parts[0] for t in self.moments.values()]
        return super().unit_parts(unit)

    def _optimizer_state(self, progress: Progress) -> dict[str, Any]:
        assert self.groups is not None and self.optimizer is not None
        scalars = self.optimizer.get("state", {})
        moments: dict[str, list[Any]] = {}
        for t in self.moments.values():
            moments.setdefault(str(t.desc.param), []).append(t)
        state: dict[int, dict[str, Any]] = {}
        groups = []
        i = 0
        for g in self.groups:
            ids = []
            for name in g["params"]:
                per = dict(scalars.get(name, {}))
                for t in moments.get(name, ()):
                    (part,) = t.parts
                    per[t.desc.key] = produce(self.conv, part, verify=self.verify).clone()
                    if progress is not None:
                        progress(t.desc.nbytes)
                if per:
                    state[i] = per
                ids.append(i)
                i += 1
            groups.append({**g, "params": ids})
        return {"state": state, "param_groups": groups}

    def commit(self, staging: Staging, dst: str, receipts: list[UnitReceipt]) -> str:
        storage = self._txn.storage if self._txn is not None else None
        if storage is None:
            raise CkptError(f"{dst}: commit by an export that did not begin this folder")
        trees = self.conv.trees
        check_cover(receipts, len(self.weights), dst)
        if trees.scheduler is not None:
            storage.put_bytes(SCHEDULER_NAME, _bytes_of(treecodec.decode(trees.scheduler)))
        for name, st in rng_file_states(trees.rng).items():
            storage.put_bytes(name, _bytes_of(st))
        state = dict(trees.extra.get("hf_trainer_state") or {})
        state.setdefault("log_history", [])
        if "stateful_callbacks" not in state:  # the Trainer's next save indexes it by callback class
            from transformers import TrainerControl

            state["stateful_callbacks"] = {"TrainerControl": TrainerControl().state()}
        state["global_step"] = trees.step
        state.update(trainer_data_position(trees.data_position, trees.step, state))
        storage.put_bytes(STATE_NAME, (json.dumps(state, indent=2) + "\n").encode())
        model_receipts = [
            UnitReceipt(
                r.worker,
                tuple(k for k in r.units if k < len(self.shards)),
                {k: v for k, v in r.data.items() if k != OPTIMIZER_NAME},
            )
            for r in receipts
        ]
        return super().commit(staging, dst, model_receipts)


def trainer_data_position(
    position: Mapping[str, Any] | None, step: int, state: Mapping[str, Any]
) -> dict[str, Any]:
    """The ``trainer_state.json`` fields that carry the data position: a Trainer resumed at ``global_step`` skips
    that many of its batches, so the samples per step (``train_batch_size``) is what says where the data stood.

    Written only when the position says it exactly (its ``global_batch``); a Trainer state that already names
    another batch size is refused rather than overwritten."""
    batch = (position or {}).get("global_batch")
    if not isinstance(batch, int) or step <= 0:
        return {}
    have = state.get("train_batch_size")
    if have is not None and have != batch:
        raise LayoutError(
            f"--format hf-trainer: the data position says {batch} samples per step, the Trainer state "
            f"train_batch_size={have}; a resumed Trainer would skip to another sample"
        )
    return {"train_batch_size": batch}


def export(conv: Conversion, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES, storage_options: dict[str, Any] | None = None,
           verify: bool = True, **_: Any) -> TrainerExport:  # fmt: skip
    return TrainerExport(
        conv, max_shard_bytes=max_shard_bytes, storage_options=storage_options, verify=verify
    )


__all__ = [
    "TrainerExport",
    "TrainerSource",
    "detect",
    "export",
    "open_source",
    "read_rng_files",
    "rng_file_states",
    "trainer_groups",
    "trainer_param_groups",
]


def named_optimizer_state(
    path: Path, opt: Any, order: Sequence[list[str]], shapes: Mapping[str, tuple[int, ...]], what: str
) -> Iterator[tuple[Any, str, dict[str, Any]]]:
    """``(index, name, state)`` of each parameter in a Trainer's ``optimizer.pt``, named by the Trainer's grouping
    ``order`` (with weight decay, without): the file holds only indices, so a grouping or a moment shape that does
    not fit the ``what`` ("model", "adapter") is refused rather than guessed."""
    if not isinstance(opt, dict) or "param_groups" not in opt or "state" not in opt:
        raise CkptError(f"{path}: not a torch optimizer state dict (no param_groups/state)")
    groups = opt["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    if sizes != [len(o) for o in order]:
        raise LayoutError(
            f"{path}: param_groups of {sizes} parameters, but the Trainer groups this {what} as {len(order[0])} "
            f"with weight decay + {len(order[1])} without; cannot name its parameters"
        )
    name_of = {
        i: n for g, names in zip(groups, order, strict=True) for i, n in zip(g["params"], names, strict=True)
    }
    for idx, per in opt["state"].items():
        name = name_of.get(idx)
        if name is None:
            raise LayoutError(f"{path}: state of parameter {idx!r}, which no param_group lists")
        for key, value in per.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shapes[name]:
                raise LayoutError(
                    f"{path}: {key} of parameter {idx} ({name}) has shape {list(value.shape)}, the {what} tensor "
                    f"{list(shapes[name])}; the Trainer's numbering does not fit this {what}"
                )
        yield idx, name, per
