"""PEFT LoRA Trainer folders: the ``checkpoint-N/`` a ``transformers.Trainer`` writes while it trains a ``PeftModel``
(``adapter_model.safetensors``, ``adapter_config.json``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``,
``trainer_state.json``), read and written as a LoRA adapter (:class:`.peft.Adapter`) with its optimizer state and
its training state (:class:`.peft.Training`).  The other files of the folder (``training_args.bin``, a README)
are not read.

The files do not name ``optimizer.pt``'s parameters: the Trainer numbers the PeftModel's trainable parameters in
``named_parameters()`` order, those with weight decay first (:mod:`.hf_trainer`).  That order is rebuilt on the
``meta`` device (no memory, no weights): the base model from ``--config`` when given, else from the transformers
class that ``adapter_config.json`` records (``auto_mapping``) with as many layers as the adapter's names, wrapped by
PEFT with the adapter's own ``LoraConfig``.  A module's place among its siblings is fixed by the model class, not by
its sizes, so both give the Trainer's order; the group sizes and every moment's shape are then held against it, and
a folder that does not fit is refused rather than guessed.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ckpt.errors import CkptError, LayoutError
from ckpt.safe_unpickle import load_torch_file

from . import peft
from .hf_trainer import (
    OPTIMIZER_NAME,
    SCHEDULER_NAME,
    STATE_NAME,
    named_optimizer_state,
    read_rng_files,
    rng_file_states,
    trainer_groups,
)

#: what a Trainer folder holds besides the adapter (named when a target drops them)
TRAINING_PARTS = ("optimizer state", "scheduler", "RNG state", "trainer_state.json")


def is_trainer_folder(path: str) -> bool:
    """A PEFT adapter folder that a Trainer wrote as ``checkpoint-N`` (``trainer_state.json`` beside the adapter)."""
    return "://" not in path and peft.detect(path) and (Path(path) / STATE_NAME).is_file()


def _base_model(adapter: peft.Adapter, config: Mapping[str, Any] | None, where: str) -> Any:
    """The base model on the meta device: from ``config``, else from the class the PEFT config records."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if config:
        cfg = dict(config)
        model_type = cfg.pop("model_type", None)
        if not model_type:
            raise LayoutError(
                f"{where}: --config has no model_type; cannot rebuild the Trainer's parameter order"
            )
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    mapping = adapter.peft_config.get("auto_mapping") or {}
    lib, name = mapping.get("parent_library"), mapping.get("base_model_class")
    cls = None
    if isinstance(lib, str) and lib.startswith("transformers.models.") and isinstance(name, str):
        cls = getattr(importlib.import_module(lib), name, None)
    if cls is None or getattr(cls, "config_class", None) is None:
        raise LayoutError(
            f"{where}: adapter_config.json names no transformers model class (auto_mapping); pass --config with "
            "the base model's config.json so that optimizer.pt's parameters can be numbered as the Trainer did"
        )
    layers = [int(m[1]) for n in adapter.tensors if (m := re.search(r"\.layers\.(\d+)\.", n))]
    return cls(cls.config_class(num_hidden_layers=1 + max(layers, default=0)))


def _hf_name(peft_name: str) -> str:
    """``base_model.model.<module>.lora_A.default.weight`` -> ``<module>.lora_A.weight`` (the adapter's names)."""
    mod, ab, _adapter, leaf = peft_name.removeprefix(peft.PREFIX).rsplit(".", 3)
    return f"{mod}.{ab}.{leaf}"


def trainer_order(
    adapter: peft.Adapter, config: Mapping[str, Any] | None, where: str
) -> tuple[list[str], list[str]]:
    """(decay, no-decay) adapter names in the order ``Trainer.create_optimizer`` numbers the PeftModel's trainable
    parameters (see the module docstring)."""
    try:
        from peft import LoraConfig, get_peft_model
        from transformers import Trainer
    except ImportError:
        raise CkptError(f"{where}: reading a Trainer's optimizer.pt needs transformers and peft") from None
    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    kw = {k: v for k, v in adapter.to_peft_config().items() if k in fields}
    kw["inference_mode"] = False  # a saved config says True; the Trainer trained it
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(_base_model(adapter, config, where), LoraConfig(**kw))
    decay = set(Trainer.get_decay_parameter_names(None, model))  # self is unused
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    hf = {n: _hf_name(n) for n in names}
    odd = sorted(set(hf.values()) ^ set(adapter.tensors))
    if odd:
        raise LayoutError(
            f"{where}: the PeftModel rebuilt from adapter_config.json trains {len(names)} tensors, the adapter "
            f"holds {len(adapter.tensors)} ({odd[0]} is in one only); cannot number optimizer.pt's parameters"
        )
    return [hf[n] for n in names if n in decay], [hf[n] for n in names if n not in decay]


def read_optimizer(path: Path, adapter: peft.Adapter, order: tuple[list[str], list[str]]) -> dict[str, Any]:
    """``optimizer.pt`` in :attr:`.peft.Adapter.optimizer`'s form (state and groups keyed by adapter names)."""
    opt = load_torch_file(path)
    shapes = {n: tuple(t.shape) for n, t in adapter.tensors.items()}
    state = {name: dict(per) for _, name, per in named_optimizer_state(path, opt, order, shapes, "adapter")}
    pg = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": names}
        for g, names in zip(opt["param_groups"], order, strict=True)
        if names
    ]
    return {"state": state, "param_groups": pg}


def read_trainer_step(path: str) -> int:
    """``trainer_state.json``'s ``global_step`` (one-line error when it has none)."""
    state_file = Path(path) / STATE_NAME
    try:
        return int(json.loads(state_file.read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CkptError(f"{state_file}: not a Trainer state ({type(exc).__name__}: {exc})") from None


def read_trainer_adapter(path: str, config: Mapping[str, Any] | None = None) -> peft.Adapter:
    """A LoRA Trainer folder as an adapter with its optimizer (when ``optimizer.pt`` is there) and training state."""
    root = Path(path)
    adapter = peft.read_adapter(path)
    step = read_trainer_step(path)
    state = json.loads((root / STATE_NAME).read_text())
    if (root / OPTIMIZER_NAME).is_file():
        order = trainer_order(adapter, config, str(root / OPTIMIZER_NAME))
        adapter.optimizer = read_optimizer(root / OPTIMIZER_NAME, adapter, order)
    sched = load_torch_file(root / SCHEDULER_NAME) if (root / SCHEDULER_NAME).is_file() else None
    adapter.training = peft.Training(step, sched, read_rng_files(root), state)
    return adapter


class AdapterFolder:
    """A PEFT adapter folder (a Trainer's LoRA ``checkpoint-N`` too) read whole, as ``ls`` / ``inspect`` /
    ``verify`` read a conversion source: ``tensors`` (the adapter's HF names, and ``optim/<name>/<key>`` for the
    optimizer's moments), ``read``, the step a Trainer folder records."""

    layout = "cuda"

    def __init__(self, path: str, config: Mapping[str, Any] | None = None) -> None:
        from ckpt.format.dtypes import dtype_name
        from ckpt.format.manifest import TensorDesc

        trainer = is_trainer_folder(path)
        self.adapter = read_trainer_adapter(path, config) if trainer else peft.read_adapter(path)
        self.format = "hf-trainer-lora" if trainer else "peft"
        self.title = "HF Trainer LoRA" if trainer else "PEFT adapter"
        self.step_recorded = trainer
        self.step = self.adapter.training.step if self.adapter.training is not None else None
        self.trees = SimpleNamespace(step=self.step)  # where a conversion source keeps its step
        self._tensors: dict[str, torch.Tensor] = dict(self.adapter.tensors)
        self.tensors: dict[str, Any] = {}
        for name, t in self.adapter.tensors.items():
            self.tensors[name] = TensorDesc(name, "parameter", tuple(t.shape), dtype_name(t.dtype))
        for name, per in ((self.adapter.optimizer or {}).get("state") or {}).items():
            for key, v in per.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    n = f"optim/{name}/{key}"
                    self._tensors[n] = v
                    self.tensors[n] = TensorDesc(
                        n, "optimizer_state", tuple(v.shape), dtype_name(v.dtype), name, key
                    )

    def read(self, piece: Any) -> torch.Tensor:
        return self._tensors[piece.name]

    def close(self) -> None:
        self._tensors = {}


def dropped(adapter: peft.Adapter, holds: tuple[str, ...], target: str) -> tuple[str, ...]:
    """The one summary line naming what ``target`` cannot hold of a Trainer folder's state (none when nothing)."""
    if adapter.training is None:
        return ()
    t = adapter.training
    have = {
        "optimizer state": adapter.optimizer is not None,
        "scheduler": t.scheduler is not None,
        "RNG state": bool(t.rng),
        "trainer_state.json": bool(t.trainer_state),
    }
    lost = [p for p in TRAINING_PARTS if have[p] and p not in holds]
    return (f"not written: {', '.join(lost)} ({target} cannot hold them)",) if lost else ()


def _bytes_of(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_trainer_folder(
    adapter: peft.Adapter,
    dst: str,
    *,
    step: int,
    config: Mapping[str, Any] | None,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """``adapter`` as a Trainer ``checkpoint-N`` folder that ``Trainer.train(resume_from_checkpoint=dst)`` resumes:
    the PEFT files, ``optimizer.pt`` in the Trainer's numbering, the scheduler, RNG files and ``trainer_state.json``
    (all checked and built before the folder is begun, published whole).  Returns the bytes written."""
    from safetensors.torch import save

    from ckpt.storage.folder import begin_folder

    where = "--format hf-trainer"
    files: dict[str, bytes] = {}
    if adapter.optimizer is not None:
        decay, rest = trainer_order(adapter, config, where)
        groups = trainer_groups(adapter.optimizer, decay, rest, where)
        state: dict[int, dict[str, Any]] = {}
        numbered: list[list[int]] = []
        i = 0
        for g in groups:
            ids = []
            for name in g["params"]:
                per = adapter.optimizer["state"].get(name)
                if per:
                    state[i] = dict(per)
                ids.append(i)
                i += 1
            numbered.append(ids)
        files[OPTIMIZER_NAME] = _bytes_of(
            {
                "state": state,
                "param_groups": [{**g, "params": ids} for g, ids in zip(groups, numbered, strict=True)],
            }
        )
    training = adapter.training or peft.Training(step)
    if training.scheduler is not None:
        files[SCHEDULER_NAME] = _bytes_of(training.scheduler)
    for name, st in rng_file_states(training.rng).items():
        files[name] = _bytes_of(st)
    trainer_state = dict(training.trainer_state)
    trainer_state.setdefault("log_history", [])
    if "stateful_callbacks" not in trainer_state:  # the Trainer's next save indexes it by callback class
        from transformers import TrainerControl

        trainer_state["stateful_callbacks"] = {"TrainerControl": TrainerControl().state()}
    trainer_state["global_step"] = step
    files[peft.WEIGHTS_NAME] = save(
        {peft.PREFIX + n: t.detach().contiguous() for n, t in adapter.tensors.items()},
        metadata={"format": "pt"},
    )
    config_bytes = (json.dumps(adapter.to_peft_config(), indent=2, sort_keys=True) + "\n").encode()
    with begin_folder(dst, storage_options) as txn:
        for name, data in files.items():
            txn.storage.put_bytes(name, data)
        # trainer_state.json last but one, the adapter config (what detection looks for) at the commit
        txn.storage.put_bytes(STATE_NAME, (json.dumps(trainer_state, indent=2) + "\n").encode())
        txn.commit({peft.CONFIG_NAME: config_bytes})
    return sum(len(d) for d in files.values()) + len(config_bytes)


__all__ = [
    "AdapterFolder",
    "TRAINING_PARTS",
    "dropped",
    "is_trainer_folder",
    "read_optimizer",
    "read_trainer_adapter",
    "read_trainer_step",
    "trainer_order",
    "write_trainer_folder",
]
