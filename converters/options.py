"""What a conversion produces (:class:`ConvertOptions`) and how it runs (:class:`RunOptions`).

Layout flags are not restated here: ``layout`` holds the :class:`~ckpt.layouts.spec.NxdFlags` fields the caller
asked for (the rest come from the source's own layout, or NxdFlags' defaults), and ``source_flags`` the flags of an
NxD tag that its files cannot record.  Every unknown flag name is refused when the options are made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ckpt.errors import CkptError, LayoutError
from ckpt.layouts.spec import NxdFlags

from .formats import BY_NAME
from .jsonfile import read_json_object

DEFAULT_FLUSH_BYTES = 64 << 20
DEFAULT_SHARD_BYTES = 5 << 30
#: the Neuron flags that may describe an NxD tag SRC where its files cannot (``--source-hw`` ...)
SOURCE_FLAGS = ("hw", "kv_size_multiplier", "virtual_pp")
#: of those, what an NxD tag's files never tell (the others are found from its shapes and placement): with both
#: sides Neuron, such a flag given without a side could mean either
UNREADABLE_FLAGS = ("hw",)


@dataclass(frozen=True)
class ConvertOptions:
    """What to produce.

    ``to``: the target layout; ``format``: the output format (``ckpt`` holds either layout, ``hf``/``dcp`` the CUDA
    layout, ``nxd`` the Neuron layout); ``from_``: the layout SRC must have (checked); ``layout``: target NxdFlags
    fields (``{"tp": 8, "qkv_linear": True}``), default: the source's own Neuron layout, else NxdFlags' defaults;
    ``source_flags``: ``hw`` / ``kv_size_multiplier`` / ``virtual_pp`` (/ ``qkv_linear`` / ``fuse_qkv``) of an NxD tag
    source; ``config``: the HF ``config.json`` dict; ``step``: the step to record; ``max_shard_bytes``: HF shard size;
    ``xser`` / ``zero1``: NxD output forms (default: the source's); ``codec``: our format's data codec;
    ``replicated``: globs (``fnmatch``, whole tensor names) of tensors the layout rule set does not know that are
    replicated on every TP rank (``--replicated``); any other unknown tensor of a Neuron layout is refused, and the
    copies of a declared one are compared wherever several are read.
    ``xser`` / ``zero1``: NxD output forms (default: the source's); ``codec``: our format's data codec; ``peft``
    is the LoRA adapter format (see :mod:`.lora`).
    """

    to: Literal["cuda", "neuron"]
    format: str = "ckpt"
    from_: Literal["cuda", "neuron"] | None = None
    layout: Mapping[str, Any] = field(default_factory=dict)
    source_flags: Mapping[str, Any] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    step: int | None = None
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    xser: bool | None = None
    zero1: bool | None = None
    codec: str = "raw"
    #: NxD tag source: the parameter name of each optimizer pid per (tp, pp, ep) rank, for optimizers built with a
    #: param grouping other than one group or NxD's weight-decay split (see docs/nxd.md)
    param_names: Mapping[tuple[int, int, int], Sequence[str]] | None = field(default=None, hash=False)
    replicated: Sequence[str] = ()
    #: the HF ``model_type`` of a model whose config.json lacks one (``--model-type``); contradicting it is refused
    model_type: str | None = None
    #: a LoRA adapter (PEFT folder or NxD LoRA tag) to merge into SRC, the base HF model (``--merge-lora``)
    merge_lora: str | None = None
    #: samples the whole job consumed (``--consumed-samples``): the data position to record where SRC has none
    #: (NxD Training names its tags by it); contradicting SRC's own is refused
    consumed_samples: int | None = None
    #: Neuron flags given without a side (the CLI's ``--hw``...): they describe whichever side is Neuron
    #: (:meth:`sided`); ``layout`` and ``source_flags`` are the target's and the source's, named
    neuron_flags: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_type is not None and self.config is not None:
            have = self.config.get("model_type")
            if have is not None and have != self.model_type:
                raise LayoutError(
                    f"--model-type {self.model_type} contradicts config.json model_type {have!r}"
                )
            object.__setattr__(self, "config", {**self.config, "model_type": self.model_type})
        if self.consumed_samples is not None and self.consumed_samples < 0:
            raise CkptError(f"--consumed-samples {self.consumed_samples} must be >= 0")
        if isinstance(self.replicated, str):
            raise CkptError(f"replicated={self.replicated!r}: expected a list of globs, not one string")
        object.__setattr__(self, "replicated", tuple(self.replicated))
        if self.step is not None and (
            isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0
        ):
            raise CkptError(f"--step {self.step!r}: expected a non-negative integer")
        if self.to not in ("cuda", "neuron"):
            raise CkptError(f"--to {self.to!r} must be cuda or neuron")
        if self.format not in BY_NAME:
            raise CkptError(f"--format {self.format!r} must be one of {', '.join(BY_NAME)}")
        unknown = sorted((set(self.layout) | set(self.neuron_flags)) - set(NxdFlags.names()))
        if unknown:
            raise CkptError(f"unknown layout flag {unknown[0]!r}; known: {', '.join(NxdFlags.names())}")

    def sided(self, nxd_tag_src: bool) -> ConvertOptions:
        """These options with :attr:`neuron_flags` put on the side that is Neuron: SRC's when it is an NxD tag and
        DST is CUDA, else the target's.  Both sides Neuron (an NxD tag SRC) and a flag its files never tell: which
        side it means is not guessed, one line names the two prefixed flags."""
        if not self.neuron_flags:
            return self
        layout, source = dict(self.layout), dict(self.source_flags)
        for name, value in self.neuron_flags.items():
            flag = name.replace("_", "-")
            if self.to == "neuron" and nxd_tag_src and name in UNREADABLE_FLAGS:
                raise CkptError(
                    f"--{flag}: SRC and DST are both Neuron layouts; say which with --source-{flag} (SRC's) or "
                    f"--target-{flag} (DST's)"
                )
            to_source = self.to == "cuda" and nxd_tag_src and name in SOURCE_FLAGS
            side = source if to_source else layout
            if name in side:
                raise CkptError(f"--{flag} and --{'source' if to_source else 'target'}-{flag} both given; drop one")
            side[name] = value
        return dataclasses.replace(self, layout=layout, source_flags=source, neuron_flags={})

    @classmethod
    def neuron(cls, **kw: Any) -> ConvertOptions:
        """``to="neuron"`` with the layout flags given as keywords: ``ConvertOptions.neuron(tp=8, pp=2)``."""
        flags = {k: kw.pop(k) for k in list(kw) if k in NxdFlags.names()}
        return cls(to="neuron", layout=flags, **kw)


@dataclass(frozen=True)
class RunOptions:
    """How to run a conversion: ``workers`` local processes (torchrun ranks are found from the environment),
    the streaming writer's ``flush_bytes``, fsspec ``storage_options`` for object stores, ``verify`` (checksums,
    NxD zip CRCs and replica comparisons on read), ``allow_unmarked`` (use an NxD training tag without ``done``)."""

    workers: int = 1
    flush_bytes: int = DEFAULT_FLUSH_BYTES
    storage_options: dict[str, Any] | None = field(default=None, hash=False)
    verify: bool = True
    allow_unmarked: bool = False

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise CkptError(f"--workers {self.workers} must be >= 1")


def load_config(path: str | None) -> dict[str, Any] | None:
    """An HF ``config.json`` as a dict (one-line error when unreadable)."""
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
        if not p.is_file():
            raise CkptError(
                f"--config {path}: a directory without config.json; pass the model's config.json (or its folder)"
            )
    return read_json_object(p, f"--config {path}")


__all__ = ["ConvertOptions", "DEFAULT_FLUSH_BYTES", "RunOptions", "SOURCE_FLAGS", "load_config"]
