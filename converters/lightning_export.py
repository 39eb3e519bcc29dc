"""``ckpt convert SRC DST.ckpt --format lightning``: a Lightning ``.ckpt`` file, what ``Trainer(ckpt_path=DST)``
and ``LightningModule.load_from_checkpoint(DST)`` read.

A source that came from Lightning (a ``.ckpt`` file, or one of ours written by
:class:`ckpt.integrations.lightning.CkptCheckpointIO` or converted from one) carries Lightning's whole dict in
``extra.lightning``: it is rebuilt exactly (:func:`ckpt.integrations.lightning_state.join`), optimizer states,
loops, callbacks and schedulers included, so the training resumes from DST.  Any other source becomes a
weights-only checkpoint: ``state_dict`` under the source's tensor names (kept as they are: a LightningModule that
holds the model as ``self.model`` names its tensors ``model.<name>``), ``global_step`` the source's step,
``epoch`` 0; its optimizer state is left out and said so (Lightning numbers the parameters of the optimizer the
user builds; a name-to-number map would be a guess).

One unit: the dict is built in memory (every tensor read once) and ``torch.save``d to a hidden file beside DST,
renamed into place at the commit: DST is never half-written.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CheckpointExistsError, CkptError, LayoutError
from ckpt.integrations.lightning_state import EXTRA_KEY, join

from .engine import MODEL_ROLES, Conversion, OutPart, Staging, UnitReceipt, check_cover, produce
from .engine.export import Progress
from .hf import not_written

NOT_WRITTEN_WHY = "a Lightning .ckpt from a source not written by Lightning holds the model's state_dict only"
_FILE = "checkpoint.ckpt"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("lightning")
    except Exception:  # noqa: BLE001 - Lightning not installed: the version its 2.x line reads
        return "2.0.0"


class LightningExport:
    """DST as one ``.ckpt`` file (see the module docstring)."""

    def __init__(self, conv: Conversion, *, verify: bool = True) -> None:
        if conv.to != "cuda":
            raise LayoutError("--format lightning holds the CUDA layout; use --to cuda")
        self.conv = conv
        self.verify = verify
        self.outs = {t.desc.name: t for t in conv.tensors}
        self.tree = (conv.trees.extra or {}).get(EXTRA_KEY)
        kept = self.outs if self.tree is not None else {
            n: t for n, t in self.outs.items() if t.desc.role in MODEL_ROLES
        }
        self.kept = tuple(kept)
        holds = frozenset({"optimizer param groups", "scheduler state"}) if self.tree is not None else frozenset()
        self.not_written = not_written(conv, kept, holds)
        self.weights = [sum(self.outs[n].desc.nbytes for n in self.kept) or 1]

    def begin(self, dst: str) -> Staging:
        if "://" in dst:
            raise CkptError(f"{dst}: --format lightning writes a local .ckpt file")
        if os.path.lexists(dst):
            raise CheckpointExistsError(f"{dst} already exists; choose another DST")
        tmp = Path(dst).parent / f".{Path(dst).name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        return Staging(str(tmp), tmp.name)

    def held_bytes(self, retained: Any) -> int:
        return self.weights[0]  # the whole dict is held for torch.save

    def unit_parts(self, unit: int) -> Sequence[OutPart]:
        return [p for n in self.kept for p in self.outs[n].parts]

    def _tensor(self, name: str, progress: Progress) -> torch.Tensor:
        (part,) = self.outs[name].parts
        t = produce(self.conv, part, verify=self.verify).detach().cpu().clone()
        if progress is not None:
            progress(self.outs[name].desc.nbytes)
        return t

    def checkpoint(self, progress: Progress = None) -> dict[str, Any]:
        if self.tree is not None:
            return join(lambda n: self._tensor(n, progress), list(self.kept), self.tree)
        step = int(self.conv.trees.step)
        return {
            "epoch": 0,
            "global_step": step,
            "pytorch-lightning_version": _version(),
            "state_dict": OrderedDict((n, self._tensor(n, progress)) for n in self.kept),
        }

    def write(self, staging: Staging, units: Sequence[int], progress: Progress = None, *, worker: int = 0) -> UnitReceipt:
        if not units:
            return UnitReceipt(worker, (), {})
        path = Path(staging.url) / _FILE
        torch.save(self.checkpoint(progress), path)
        return UnitReceipt(worker, tuple(units), {_FILE: path.stat().st_size})

    def commit(self, staging: Staging, dst: str, receipts: list[UnitReceipt]) -> str:
        check_cover(receipts, 1, dst)
        src = Path(staging.url) / _FILE
        if not src.is_file():
            raise CkptError(f"{dst}: the staged {_FILE} is missing")
        os.replace(src, dst)
        shutil.rmtree(staging.url, ignore_errors=True)
        return dst

    def abort(self, staging: Staging) -> None:
        shutil.rmtree(staging.url, ignore_errors=True)


def export(conv: Conversion, *, verify: bool = True, **_: Any) -> LightningExport:
    return LightningExport(conv, verify=verify)


__all__ = ["LightningExport", "NOT_WRITTEN_WHY", "export"]
