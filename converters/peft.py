"""PEFT LoRA adapter folders: ``adapter_config.json`` + ``adapter_model.safetensors`` (what
``PeftModel.save_pretrained`` writes and ``PeftModel.from_pretrained`` loads).

Tensor names are PEFT's: ``base_model.model.<HF module>.lora_A.weight`` / ``lora_B.weight`` (the adapter name is not
part of them).  ckpt handles plain LoRA only; a config asking for anything ckpt cannot carry to NxD or merge exactly
(DoRA, ``fan_in_fan_out``, lora biases, ``modules_to_save``, non-LoRA PEFT types) is refused when the folder is
opened, naming the key.  Per-module ranks and alphas (``rank_pattern``/``alpha_pattern``) are resolved as PEFT
resolves them (:func:`pattern_key`).  A PEFT folder holds no optimizer state.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CorruptionError, LayoutError
from ckpt.layouts.lora import parse_hf

from .jsonfile import read_json_object

NAME = "peft"
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."


def detect(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    p = Path(path)
    return (p / CONFIG_NAME).is_file() and (p / WEIGHTS_NAME).is_file()


@dataclass
class Training:
    """What a Trainer ``checkpoint-N`` folder holds besides the adapter and its optimizer (:mod:`.lora_trainer`):
    the step, the scheduler's state dict, the RNG streams by rank (encoded trees, as
    :func:`.hf_trainer.read_rng_files` reads them) and ``trainer_state.json``."""

    step: int
    scheduler: dict[str, Any] | None = None
    rng: dict[str, Any] = field(default_factory=dict)
    trainer_state: dict[str, Any] = field(default_factory=dict)


@dataclass
class Adapter:
    """A LoRA adapter in HF naming (no ``base_model.model.`` prefix), with the LoRA hyper-parameters that matter to
    its math (rank, alpha, rsLoRA) and the PEFT config it came with (kept whole so a round trip returns it)."""

    tensors: dict[str, torch.Tensor]
    r: int
    lora_alpha: float
    use_rslora: bool = False
    lora_dropout: float = 0.0
    peft_config: dict[str, Any] = field(default_factory=dict)
    #: the adapter's optimizer state, when the source has it: ``{"state": {hf_name: {key: tensor | scalar}},
    #: "param_groups": [{..., "params": [hf_name, ...]}]}`` (torch.optim's form, keyed by HF adapter names)
    optimizer: dict[str, Any] | None = None
    #: one-line remarks for the summary (e.g. how a widened NxD adapter came back)
    notes: tuple[str, ...] = ()
    #: the training state of a Trainer folder (or of a conversion of one), None for a bare adapter
    training: Training | None = None

    @classmethod
    def of_config(
        cls, tensors: dict[str, torch.Tensor], cfg: dict[str, Any], optimizer: dict[str, Any] | None = None
    ) -> Adapter:
        """An adapter of ``tensors`` with the hyper-parameters of PEFT config ``cfg`` (kept whole)."""
        return cls(
            tensors=tensors,
            r=int(cfg["r"]),
            lora_alpha=cfg["lora_alpha"],
            use_rslora=bool(cfg.get("use_rslora", False)),
            lora_dropout=float(cfg.get("lora_dropout") or 0.0),
            peft_config=cfg,
            optimizer=optimizer,
        )

    @property
    def scaling(self) -> float:
        """NxD's and PEFT's ``scaling``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def rank_of(self, module: str) -> int:
        """``module``'s rank: ``rank_pattern`` resolved as PEFT does, else ``r``."""
        patterns = self.peft_config.get("rank_pattern") or {}
        key = pattern_key(patterns, module)
        return int(patterns[key]) if key is not None else self.r

    def alpha_of(self, module: str) -> float:
        """``module``'s alpha: ``alpha_pattern`` resolved as PEFT does, else ``lora_alpha``."""
        patterns = self.peft_config.get("alpha_pattern") or {}
        key = pattern_key(patterns, module)
        return patterns[key] if key is not None else self.lora_alpha

    def scaling_of(self, module: str) -> float:
        """``module``'s scaling, computed as PEFT's ``LoraLayer.update_layer`` does."""
        r = self.rank_of(module)
        return self.alpha_of(module) / (math.sqrt(r) if self.use_rslora else r)

    @property
    def modules(self) -> list[str]:
        """Adapted HF modules, in tensor order."""
        return list(dict.fromkeys(parse_hf(n)[0] for n in self.tensors))

    def to_peft_config(self) -> dict[str, Any]:
        """The ``adapter_config.json`` to write: the source's PEFT config if it had one, else a minimal one."""
        if self.peft_config:
            return dict(self.peft_config)
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
            "use_rslora": self.use_rslora,
            "bias": "none",
            "fan_in_fan_out": False,
            "target_modules": sorted({m.rsplit(".", 1)[-1] for m in self.modules}),
            "modules_to_save": None,
            "inference_mode": True,
            "base_model_name_or_path": None,
        }


_REFUSED = {
    "use_dora": (False, "DoRA adapters"),
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D-style) adapters"),
    "bias": ("none", "trained biases"),
    "modules_to_save": (None, "modules_to_save (fully trained extra modules)"),
}


def pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """The ``rank_pattern``/``alpha_pattern`` key that applies to ``module`` (HF name), as PEFT's
    ``utils.other.get_pattern_key`` picks it (the first key in order whose regex ends the name), or None."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def check_config(cfg: Mapping[str, Any], where: str) -> None:
    """Refuse what a plain LoRA adapter cannot carry exactly (one line naming the key)."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LayoutError(f"{where}: peft_type {cfg.get('peft_type')!r}; ckpt converts LORA adapters only")
    for key, (ok, what) in _REFUSED.items():
        value = cfg.get(key)
        if value is None or value == ok or value in ({}, [], False):
            continue
        raise LayoutError(f"{where}: {key}={value!r}: {what} are not supported (expected {ok!r})")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or isinstance(cfg.get(key), bool):
            raise LayoutError(f"{where}: {key} must be a number, got {cfg.get(key)!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        value = cfg.get(key) or {}
        if not isinstance(value, dict) or any(
            not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0 for v in value.values()
        ):
            raise LayoutError(f"{where}: {key} must map module patterns to positive numbers, got {value!r}")


def read_adapter(path: str) -> Adapter:
    """Read a PEFT adapter folder (checked: config, names, one LoRA rank)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    cfg_path = p / CONFIG_NAME
    cfg = read_json_object(
        cfg_path, str(cfg_path), missing=" (a PEFT adapter folder has adapter_config.json)", damaged=CorruptionError
    )
    check_config(cfg, str(cfg_path))
    try:
        raw = load_file(str(p / WEIGHTS_NAME))
    except (SafetensorError, OSError) as e:
        raise CorruptionError(f"{p / WEIGHTS_NAME}: not a readable safetensors file ({e})") from None
    tensors: dict[str, torch.Tensor] = {}
    ranks = Adapter(tensors={}, r=int(cfg["r"]), lora_alpha=cfg["lora_alpha"], peft_config=cfg)
    for name, t in raw.items():
        if not name.startswith(PREFIX):
            raise LayoutError(
                f"{p / WEIGHTS_NAME}: tensor {name} does not start with {PREFIX!r} (PEFT's naming)"
            )
        hf = name[len(PREFIX) :]
        mod, ab = parse_hf(hf)
        tensors[hf] = t
        r = t.shape[0] if ab == "A" else t.shape[-1]
        if r != ranks.rank_of(mod):
            raise LayoutError(
                f"{p / WEIGHTS_NAME}: {name} has LoRA rank {r}, adapter_config.json says r={ranks.rank_of(mod)}"
            )
    if not tensors:
        raise LayoutError(f"{p / WEIGHTS_NAME}: holds no LoRA tensors")
    return Adapter.of_config(tensors, cfg)


def write_adapter(adapter: Adapter, dst: str, storage_options: dict[str, Any] | None = None) -> int:
    """Write ``adapter`` as a PEFT folder at ``dst`` (published whole, config last); returns bytes written."""
    from safetensors.torch import save

    from ckpt.storage.folder import begin_folder

    data = save(
        {PREFIX + n: t.detach().contiguous() for n, t in adapter.tensors.items()}, metadata={"format": "pt"}
    )
    config = (json.dumps(adapter.to_peft_config(), indent=2, sort_keys=True) + "\n").encode()
    with begin_folder(dst, storage_options) as txn:
        txn.storage.put_bytes(WEIGHTS_NAME, data)
        txn.commit({CONFIG_NAME: config})
    return len(data) + len(config)


__all__ = [
    "Adapter",
    "CONFIG_NAME",
    "NAME",
    "PREFIX",
    "Training",
    "WEIGHTS_NAME",
    "check_config",
    "detect",
    "pattern_key",
    "read_adapter",
    "write_adapter",
]
