"""The formats ``ckpt convert`` reads and writes: ONE table (:data:`FORMATS`), one entry per format.

An entry says everything the rest of the tool needs to know about a format: the module with its verbs, the layouts
it holds, its ``--format`` help, how to recognise it in a folder (for the unknown-layout hint), the CLI options that
only it uses, whether its SRC is an NxD tag (``--source-*`` flags) and how its output records a missing step.
Options validation, the CLI's ``--format`` choices and help, the idle-flag refusals, the hints and ``convert``'s
dispatch are all read from here; nothing else names a format.

A format's module provides the verbs it supports: ``detect(path, storage_options)``,
``open_source(path, **options) -> Source`` (read), ``export(conv, **options) -> Export`` (write), and where SRC may be
a LoRA adapter, ``is_adapter(path, storage_options)``; where the format's own readers fix the Neuron layout
(``fits_layout``), ``fit_flags(flags, given, config) -> NxdFlags``; the adapter entry's module converts whole
(``convert(found, dst, opts, run)``) instead of going through the engine.  Modules are imported only when a format is
used, so the table itself stays cheap to import (the CLI builds its options from it).
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
    #: the module with the format's verbs (relative to this package)
    module: str
    #: the target layouts this format can hold
    holds: tuple[str, ...]
    #: one phrase for ``ckpt convert --help``
    help: str
    #: what the format is called in prose (``ckpt inspect``/``verify`` of a folder that is not ours)
    title: str = ""
    #: read from (and written to) object stores, not only local folders
    remote: bool = False
    #: what marks a folder of this format (the unknown-layout error lists these)
    looks_like: str | None = None
    #: CLI options (parameter names) that mean something for this output format only
    options: tuple[str, ...] = ()
    #: SRC is an NxD tag (alone or in a folder): the ``--source-*`` flags and ``param_names`` apply
    nxd_tag: bool = False
    #: how the output records the step when SRC records none (None: the format records no step)
    step_note: str | None = None
    #: a SRC of this format may be a LoRA adapter (its module's ``is_adapter`` says)
    adapters: bool = False
    #: the LoRA adapter entry: conversions that read, write or merge an adapter run its module's ``convert`` whole
    whole: bool = False
    #: named in the "--format X holds the ... layout; use --to ... or --format ..." refusal
    suggested: bool = False
    #: the format's readers build the Neuron layout from the model themselves: its module's
    #: ``fit_flags(flags, given, config)`` sets the flags not given and refuses the ones that contradict it
    fits_layout: bool = False

    def __str__(self) -> str:
        return self.title or self.name

    def load(self) -> ModuleType:
        return importlib.import_module(self.module, __package__)


#: in detection order (the first whose ``detect`` accepts a folder is its format)
FORMATS: tuple[Format, ...] = (
    Format("ckpt", ".ckpt", ("cuda", "neuron"), "ours, either layout", remote=True, looks_like="manifest.json",
           options=("codec",), step_note="the output records step 0", adapters=True, suggested=True),
    Format("lightning", ".lightning", ("cuda",), "a PyTorch Lightning .ckpt file", "Lightning",
           looks_like="a Lightning .ckpt file"),
    Format("dcp", ".dcp", ("cuda",), "torch.distributed.checkpoint", "DCP", looks_like="a DCP .metadata",
           suggested=True),
    Format("optimum-neuron", ".optimum_neuron", ("neuron",), "a NeuronTrainer checkpoint-N folder",
           options=("xser",), nxd_tag=True, adapters=True, fits_layout=True),
    Format("hf-trainer", ".hf_trainer", ("cuda",), "an HF Trainer checkpoint-N folder", "HF Trainer",
           step_note="its trainer_state.json records global_step 0"),
    # before "hf": a save_state folder may hold the model's config.json beside its model.safetensors
    Format("accelerate", ".accelerate", ("cuda",), "an accelerate save_state folder", "accelerate",
           looks_like="an accelerate save_state folder (random_states_0.pkl, optimizer.bin)",
           step_note="save_state records none either"),
    Format("hf", ".hf", ("cuda",), "a Hugging Face model folder", "Hugging Face",
           looks_like="an HF config.json + *.safetensors (with trainer_state.json: a Trainer checkpoint)",
           options=("max_shard_size",), suggested=True),
    # an NxD tag written by NxD Training: before plain "nxd"
    Format("nxdt", ".nxd.training", ("neuron",), "an NxD Training tag", options=("xser",), nxd_tag=True),
    Format("nxd", ".nxd", ("neuron",), "an NxD tag", looks_like="NxD model/ rank files", options=("xser",),
           nxd_tag=True, step_note="the NxD tag records none either", adapters=True, suggested=True),
    Format("peft", ".lora", ("cuda",), "a PEFT LoRA adapter folder", adapters=True, whole=True),
)  # fmt: skip
BY_NAME = {f.name: f for f in FORMATS}
#: the entry that converts LoRA adapters (read, written or merged), whole and in one process
ADAPTER = next(f for f in FORMATS if f.whole)


def names() -> list[str]:
    """The ``--format`` choices, sorted."""
    return sorted(BY_NAME)


def get(name: str) -> Format:
    try:
        return BY_NAME[name]
    except KeyError:
        raise CkptError(f"--format {name!r}: expected one of {', '.join(BY_NAME)}") from None


def owners(option: str) -> list[str]:
    """The output formats a format-only CLI option (parameter name) means something for, sorted."""
    return sorted(f.name for f in FORMATS if option in f.options)


def format_options() -> list[str]:
    """Every format-only CLI option (parameter names), in table order."""
    return list(dict.fromkeys(o for f in FORMATS for o in f.options))


@dataclass(frozen=True)
class Detected:
    """What SRC is, found once per conversion and passed down: its format entry, whether it holds a LoRA adapter,
    and what detection already read (our manifest), so that nothing probes or parses SRC again."""

    path: str
    format: Format
    adapter: bool = False
    #: our format's top manifest, when detection parsed it (None: not ours, or unreadable: the reader says why)
    manifest: Any = None


def detect(src: str, storage_options: Mapping[str, Any] | None = None) -> Format:
    """The format of the checkpoint at ``src`` as a model (one-line error when none fits)."""
    return _detect_model(src, storage_options)


def detect_source(
    src: str, storage_options: Mapping[str, Any] | None = None, *, adapters: Detected | None = None
) -> Detected:
    """SRC's format, adapter or model: the one probe of a conversion (one-line error when none fits).
    ``adapters``: the adapter pass (:func:`detect_adapter`) already run on ``src``, not run again."""
    found = adapters if adapters is not None else detect_adapter(src, storage_options)
    if found.adapter:
        return found
    fmt = _detect_model(src, storage_options)
    return Detected(src, fmt, manifest=found.manifest if fmt is found.format else None)


def detect_adapter(src: str, storage_options: Mapping[str, Any] | None = None) -> Detected:
    """The adapter pass of :func:`detect_source`.  When SRC holds no LoRA adapter, ``adapter`` is False and
    ``format`` is ours with the model ``manifest`` read on the way, or else the adapter entry (nothing found yet)."""
    seen = Detected(src, ADAPTER)
    for fmt in FORMATS:
        if not fmt.adapters or (_remote(src) and not fmt.remote):
            continue
        found = fmt.load().is_adapter(src, storage_options)
        if found is True:
            return Detected(src, fmt, adapter=True)
        if found is not None and found is not False:  # what it read to decide (our manifest): handed down
            if found.adapter is not None:
                return Detected(src, fmt, adapter=True, manifest=found)
            seen = Detected(src, fmt, manifest=found)
    return seen


def _remote(src: str) -> bool:
    return "://" in src and not src.startswith("file://")


def _detect_model(src: str, storage_options: Mapping[str, Any] | None) -> Format:
    from ckpt.storage import refuse_mangled_url

    refuse_mangled_url(src)
    remote = _remote(src)
    if not remote and not Path(src).exists():
        raise CkptError(f"{src}: no such file or directory")
    for fmt in FORMATS:
        if (fmt.remote or not remote) and fmt.load().detect(src, storage_options):
            return fmt
    if remote:
        raise CkptError(f"{src}: no manifest.json; only our format is read from object stores")
    from ckpt.restoring.other_tools import not_supported, tool_at

    other = tool_at(src)
    if other is not None:  # another tool's checkpoint: named, not "unknown layout"
        raise CkptError(not_supported(src, other))
    _refuse_a_root(src)
    from .nxd.naming import part_of_tag

    part = part_of_tag(src)
    if part is not None:
        raise CkptError(part)
    marks = [f.looks_like for f in FORMATS if f.looks_like]
    raise LayoutError(f"{src}: unknown checkpoint layout (expected {', '.join(marks[:-1])}, or {marks[-1]})")


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
    from .accelerate import detect as accelerate_folder

    def numbered(name: str) -> tuple[str, int]:  # checkpoint_10 after checkpoint_9
        stem = name.rstrip("0123456789")
        return stem, int(name[len(stem) :] or -1)

    saved = sorted((d.name for d in p.iterdir() if d.is_dir() and accelerate_folder(str(d))), key=numbered)
    if saved:  # automatic_checkpoint_naming's checkpoints/ folder
        raise CkptError(holds_not_one(src, saved, "accelerate save_state folder", "ckpt convert"))


__all__ = ["ADAPTER", "BY_NAME", "Detected", "FORMATS", "Format", "detect", "detect_adapter", "detect_source", "get", "names"]
