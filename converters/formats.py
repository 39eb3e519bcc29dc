"""The formats ``ckpt convert`` reads and writes: one table, one module per format with the same verbs.

Each format module (:mod:`.ckpt`, :mod:`.hf`, :mod:`.hf_trainer`, :mod:`.dcp`, :mod:`.nxd`,
:mod:`.optimum_neuron`) provides ``detect(path, storage_options)``,
``open_source(path, **options) -> Source`` and ``export(conv, **options) -> Export``.  Adding a format is one module
and one line here.  Modules are imported only when a format is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ckpt.errors import CkptError, LayoutError
from ckpt.words import holds_not_one


@dataclass(frozen=True)
class Format:
    name: str
    module: str
    #: the target layouts this format can hold
    holds: tuple[str, ...]
    #: read from (and written to) object stores, not only local folders
    remote: bool = False

    def load(self) -> ModuleType:
        return importlib.import_module(self.module, __package__)


#: in detection order (the first whose ``detect`` accepts a folder is its format)
FORMATS: tuple[Format, ...] = (
    Format("ckpt", ".ckpt", ("cuda", "neuron"), remote=True),
    Format("dcp", ".dcp", ("cuda",)),
    Format("optimum-neuron", ".optimum_neuron", ("neuron",)),
    Format("hf-trainer", ".hf_trainer", ("cuda",)),
    Format("hf", ".hf", ("cuda",)),
    Format("nxdt", ".nxd.training", ("neuron",)),  # an NxD tag written by NxD Training: before plain "nxd"
    Format("nxd", ".nxd", ("neuron",)),
    Format("peft", ".peft", ("cuda",)),
)
BY_NAME = {f.name: f for f in FORMATS}


def get(name: str) -> Format:
    try:
        return BY_NAME[name]
    except KeyError:
        raise CkptError(f"--format {name!r}: expected one of {', '.join(BY_NAME)}") from None


def detect(src: str, storage_options: Mapping[str, Any] | None = None) -> Format:
    """The format of the checkpoint at ``src`` (one-line error when none fits)."""
    from ckpt.storage import refuse_mangled_url

    refuse_mangled_url(src)
    remote = "://" in src and not src.startswith("file://")
    if not remote and not Path(src).exists():
        raise CkptError(f"{src}: no such file or directory")
    for fmt in FORMATS:
        if (fmt.remote or not remote) and fmt.load().detect(src, storage_options):
            return fmt
    if remote:
        raise CkptError(f"{src}: no manifest.json; only our format is read from object stores")
    _refuse_a_root(src)
    from .nxd.naming import part_of_tag

    part = part_of_tag(src)
    if part is not None:
        raise CkptError(part)
    raise LayoutError(
        f"{src}: unknown checkpoint layout (expected manifest.json, a DCP .metadata, an HF config.json + "
        "*.safetensors (with trainer_state.json: a Trainer checkpoint), or NxD model/ rank files)"
    )


def _refuse_a_root(src: str) -> None:
    """SRC one level too high: a folder of our checkpoints or of NxD tags.  Say which one to convert (never pick)."""
    from ckpt.restoring.discovery import parse_step

    p = Path(src)
    if not p.is_dir():
        return
    steps = sorted(
        d.name for d in p.iterdir() if parse_step(d.name) is not None and (d / "manifest.json").is_file()
    )
    if steps:
        raise CkptError(holds_not_one(src, steps, "checkpoint", "ckpt convert"))
    from .nxd.discovery import list_tags

    try:
        tags = [t.name for t in list_tags(p)]
    except CkptError:
        return
    if tags:
        raise CkptError(holds_not_one(src, tags, "NxD tag", "ckpt convert"))


__all__ = ["FORMATS", "Format", "detect", "get"]
