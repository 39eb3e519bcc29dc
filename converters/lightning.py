"""A PyTorch Lightning ``.ckpt`` file (``Trainer.save_checkpoint`` / ``ModelCheckpoint`` output) as a source.

The file is one ``torch.save`` pickle of Lightning's checkpoint dict.  It is read with
:func:`ckpt.safe_unpickle.load_torch_file` (``weights_only`` + an allow-list: Lightning's ``AttributeDict``, the
``Namespace``/``OrderedDict`` that ``save_hyperparameters`` may leave, and NumPy scalars); any other global is
refused with its name, nothing is executed.  Tensors are read memory-mapped.

What the source holds (the same split as :class:`ckpt.integrations.lightning.CkptCheckpointIO` writes, so a
converted file is what the plugin would have written): ``state_dict``'s tensors as model tensors under their own
names (the LightningModule's attribute paths: a ``self.model = AutoModelForCausalLM...`` module's tensors start with
``model.``; with ``--config`` the prefix under which the state_dict holds exactly that config's model is taken
off, so an HF folder gets the model's own names, and a state_dict holding it under no single prefix is refused),
each optimizer moment as ``optim/<k>.<index>/<key>`` (Lightning numbers parameters; the file does not
say which tensor a number is, so none is guessed), and everything else as ``extra.lightning`` (JSON).
``global_step`` is the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckpt.format.dtypes import dtype_name
from ckpt.format.manifest import TensorDesc
from ckpt.integrations.lightning_state import EXTRA_KEY, optimizer_tree, split
from ckpt.layouts import Piece
from ckpt.restoring.other_tools import LIGHTNING, file_tool

from .engine import Source, Trees
from .engine.source import slice_of
from .hf_prefix import model_prefix
from .lightning_pickle import load_ckpt_file

NAME = "lightning"


def detect(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    from .lightning_folders import is_deepspeed, is_fsdp_sharded

    return file_tool(path) == LIGHTNING or is_fsdp_sharded(Path(path)) or is_deepspeed(Path(path))


class LightningSource(Source):
    """A Lightning ``.ckpt`` file as a CUDA-layout source (see the module docstring)."""

    format = NAME
    layout = "cuda"
    title = "Lightning"
    #: why a layout change refuses its optimizer moments (said after the engine's "not a parameter")
    optimizer_note = (
        " (Lightning numbers the parameters of the optimizer configure_optimizers built, and the file does not say "
        "which tensor each number is; for the weights alone convert to --format hf --config first, then from there)"
    )

    def __init__(self, path: str | Path, *, config: Mapping[str, Any] | None = None) -> None:
        self.path = str(path)
        checkpoint = load_ckpt_file(Path(path))
        model, moments, tree = split(checkpoint)
        prefix = model_prefix(set(model), config, self.path) if config is not None else ""
        if prefix:  # the HF model's own names (what --config describes); extra.lightning keeps Lightning's
            model = {n[len(prefix) :] if n.startswith(prefix) else n: t for n, t in model.items()}
            tree["prefix"] = prefix
        self._tensors: dict[str, torch.Tensor] = {**model, **{m.name: m.tensor for m in moments}}
        self.tensors = {n: TensorDesc(n, "parameter", tuple(t.shape), dtype_name(t.dtype)) for n, t in model.items()}
        for m in moments:
            self.tensors[m.name] = TensorDesc(
                m.name, "optimizer_state", tuple(m.tensor.shape), dtype_name(m.tensor.dtype), m.param, m.key
            )
        step = int(checkpoint.get("global_step", 0) or 0)
        self.config = dict(config) if config is not None else None
        extra: dict[str, Any] = {EXTRA_KEY: tree}
        if self.config is not None:
            extra["config"] = self.config
        self.trees = Trees(step=step, progress={"step": step}, extra=extra)
        if moments:
            self.trees.optimizer = optimizer_tree(moments, tree)
        self.step_recorded = "global_step" in checkpoint

    def read(self, piece: Piece) -> torch.Tensor:
        t = self._tensors[piece.name]
        return t if piece.dim is None else slice_of(t, piece)

    def close(self) -> None:
        self._tensors = {}


def open_source(path: str, *, config: Mapping[str, Any] | None = None, **_: Any) -> Source:
    """The source of a ``.ckpt`` file, or of the folder Lightning's FSDP or DeepSpeed strategy writes."""
    from .lightning_folders import FsdpShardedSource, is_deepspeed, is_fsdp_sharded

    if is_deepspeed(Path(path)):
        from .lightning_deepspeed import DeepSpeedSource

        return DeepSpeedSource(path, config=config)
    if is_fsdp_sharded(Path(path)):
        return FsdpShardedSource(path, config=dict(config) if config is not None else None)
    return LightningSource(path, config=config)


# the writer side lives in its own module (it imports the engine's export machinery)
from .lightning_export import NOT_WRITTEN_WHY, LightningExport, export  # noqa: E402

__all__ = ["NOT_WRITTEN_WHY", "LightningExport", "LightningSource", "detect", "export", "load_ckpt_file", "model_prefix", "open_source"]
