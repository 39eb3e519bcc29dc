"""NxD Training (``neuronx-distributed-training``) tags: NxD files in Lightning's clothes, as a source and a target.

NxD Training saves through ``NLPCheckpointIO.save_checkpoint`` (``lightning_modules/nlp_overrides.py:580-627`` at
aws-neuron/neuronx-distributed-training 9169aa0): Lightning's checkpoint dict loses ``state_dict`` and
``optimizer_states`` (the model and optimizer files NxD's ``save_checkpoint`` writes, exactly as for any NxD tag),
and *the rest of the dict* becomes ``user_content.pt``; no ``scheduler.pt`` is written.  So, unlike a plain NxD tag:

* the step is Lightning's ``global_step`` and the scheduler is ``lr_schedulers[0]``, both in ``user_content.pt``;
* the data position is only in the tag's *name*: Lightning's ``ModelCheckpoint`` formats NxD Training's template
  ``<run>--{step}-{consumed_samples}`` (``examples/conf/hf_*_config.yaml``, ``checkpoint_callback_params.filename``)
  as ``<run>--step=N-consumed_samples=X.ckpt`` (``-last`` before ``.ckpt`` for the last checkpoint,
  ``utils/exp_manager.py:550``), and NxD Training's data module resumes from the number it parses back out of the
  path (``lightning_modules/data/base.py:40-47``).

:func:`parse_tag_name` reads that template and nothing else (a name that does not follow it yields no step and no
data position: digits elsewhere in a name are never taken for either).  Tensor names are NxD's for the ``hf_*``
models (``model.layers.N.self_attn.qkv_proj...``); Megatron-style models (``megatron_*``, names under
``language_model.``) are refused with one line, since their fused-QKV head order is not pinned here.

Target (``--format nxdt``): an NxD tag (:class:`~.export.NxdExport`) whose ``user_content.pt`` is a Lightning dict of
plain types that NxD Training's load path (``NLPCheckpointIO.load_checkpoint`` + ``NLPCheckpointConnector``) accepts,
at a DST whose name follows the template with the checkpoint's own step and consumed samples.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpt.errors import CkptError, LayoutError, UnsafePickleError
from ckpt.format import treecodec

from ..engine import Conversion, Staging
from . import source as nxd_source
from .export import NxdExport
from .files import TagFiles, scan_tag
from .source import NxdTagSource
from .step import step_sources
from .tagname import TagName, name_step, parse_tag_name
from .xser import load_checked

NAME = "nxdt"
#: ``data_position.adapter`` of a position read from an NxD Training tag name: ``samples`` is NxD Training's
#: ``consumed_samples`` (the Megatron samplers' count over the run, from which they derive the epoch themselves)
ADAPTER = "nxdt"
LIGHTNING_VERSION_KEY = "pytorch-lightning_version"

_MEGATRON = re.compile(r"(?:^|\.)language_model\.")

def is_lightning_dict(obj: Any) -> bool:
    """A Lightning checkpoint dict (what NxD Training leaves in ``user_content.pt``)."""
    return isinstance(obj, dict) and LIGHTNING_VERSION_KEY in obj and "global_step" in obj


def read_user_content(files: TagFiles, *, verify: bool = True) -> Any:
    """``user_content.pt`` through the safe unpickler; a refused global gets the NxD Training explanation."""
    if files.user_content is None:
        return None
    try:
        return load_checked(files.user_content, verify=verify)
    except UnsafePickleError as e:
        raise UnsafePickleError(
            f"{e} (NxD Training's NLPCheckpointIO converts OmegaConf containers to plain ones before saving, "
            "nlp_overrides.py:604-608; ckpt unpickles plain types and tensors only)"
        ) from None


def refuse_megatron(names: list[str], where: str) -> None:
    """One line for a Megatron-style NxD Training checkpoint (``language_model.encoder.layers.N...``)."""
    odd = next((n for n in names if _MEGATRON.search(n)), None)
    if odd is not None:
        raise LayoutError(
            f"{where}: tensor {odd!r} is a Megatron-style NxD Training name; Megatron-style NxD Training "
            "checkpoints (megatron_* models) are not supported yet (hf_* models are)"
        )


def detect(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """An NxD tag named by NxD Training's template, or whose ``user_content.pt`` is a Lightning dict."""
    if not nxd_source.detect(path, storage_options):
        return False
    try:
        if parse_tag_name(Path(path).name) is not None:
            return True
        return is_lightning_dict(read_user_content(scan_tag(path)))
    except CkptError:
        return False


def data_position(samples: int, step: int, epoch: int, dp: int, adapter: str = ADAPTER) -> dict[str, Any]:
    """Our manifest's ``data_position`` (docs/format.md) for NxD Training's ``consumed_samples``.

    NxD Training's Megatron samplers hand each DP rank its share of every global batch, so the consumed samples are
    a prefix of the global order (``prefix``); each rank's share is recorded only when it divides evenly.
    ``adapter``: who counted (``consumed_samples`` for a count given with ``--consumed-samples``).
    """
    even = dp > 0 and samples % dp == 0
    return {
        "adapter": adapter,
        "dp": dp if even else 1,
        "epoch": epoch,
        "samples": samples,
        "per_rank": [samples // dp] * dp if even else [samples],
        "prefix": True,
        "global_batch": samples // step if step and samples % step == 0 else None,
        "order": None,
        "samples_total": samples,
        "tokens": None,
    }


def consumed_samples(position: Mapping[str, Any] | None) -> int | None:
    """The samples the whole job consumed, from our ``data_position`` (None when it does not say)."""
    if not position:
        return None
    total = position.get("samples_total")
    if isinstance(total, int):
        return total
    if position.get("adapter") == ADAPTER or position.get("epoch") == 0:
        return int(position["samples"])
    return None


class NxdtSource(NxdTagSource):
    """An NxD Training tag: an NxD tag whose step, scheduler and data position come from Lightning's records."""

    format = NAME

    def __init__(self, path: str | Path, *, step: int | None = None, verify: bool = True, **kw: Any) -> None:
        files = scan_tag(path)
        self.tag_name = parse_tag_name(files.path.name)
        user = read_user_content(files, verify=verify)
        lightning = user if is_lightning_dict(user) else None
        first = files.model.get(min(files.model)) if files.model else None
        if first is not None:
            from ckpt.safe_unpickle import load_torch_file

            state = load_torch_file(first, mmap=True)
            refuse_megatron(list(state) if isinstance(state, dict) else [], str(first))
        with warnings.catch_warnings():
            # the NxD reader's step guess from the tag name's last digits ("...=12.0.ckpt" -> 0) is not used here:
            # the step of an NxD Training tag is decided below from the records that name it
            warnings.filterwarnings("ignore", message=".*sources disagree on the step")
            super().__init__(path, step=step, verify=verify, **kw)
        self.trees.step = self._step(step, files, user)
        self.trees.progress = {"step": self.trees.step}
        if lightning is not None:
            schedulers = lightning.get("lr_schedulers") or []
            if len(schedulers) > 1:
                raise LayoutError(
                    f"{files.user_content}: {len(schedulers)} lr_schedulers; NxD Training and ckpt carry one"
                )
            if schedulers:
                self.trees.scheduler = treecodec.encode(schedulers[0], "user_content.pt lr_schedulers[0]")
        if self.tag_name is not None:
            samples = self.tag_name.consumed_samples
            epoch = int(lightning.get("epoch") or 0) if lightning is not None else 0
            dp = self.r.meta.dp_size if self.r.meta.zero1 else 1
            self.trees.data_position = data_position(samples, self.trees.step, epoch, dp)
            self.trees.progress["samples"] = samples
        self.trees.extra["nxdt"] = {
            "tag": files.path.name,
            "run": self.tag_name.run if self.tag_name else None,
            "last": self.tag_name.last if self.tag_name else None,
            "lightning_version": lightning.get(LIGHTNING_VERSION_KEY) if lightning else None,
        }
        self.record = dataclasses.replace(self.record, source={**(self.record.source or {}), "format": NAME})

    def _step(self, given: int | None, files: TagFiles, user: Any) -> int:
        """``--step``, else the records that name a step, which must agree: Lightning's ``global_step`` (or another
        step key of ``user_content.pt``, a ``scheduler.pt``, as for any NxD tag) and the name's ``step=``."""
        self.step_recorded = True  # the NxD source's flag: a step some record (or --step) names
        if given is not None:
            return given
        said = [
            (w, v)
            for w, v in step_sources(files, verify=False, user_content=user)
            if not w.startswith("tag name")
        ]  # the NxD reader's own guess from a name's digits is not a record
        if self.tag_name is not None:
            said.append((f"tag name step={self.tag_name.step}", self.tag_name.step))
        if len({v for _, v in said}) > 1:
            raise LayoutError(
                f"{self.path}: the NxD Training tag's records disagree on the step ({', '.join(w for w, _ in said)}); "
                "pass --step N"
            )
        self.step_recorded = bool(said)
        return said[0][1] if said else self.trees.step


def open_source(path: str, *, step: int | None = None, verify: bool = True, **kw: Any) -> NxdtSource:
    return NxdtSource(
        path, step=step, verify=verify, config=kw.get("config"), flags=kw.get("source_flags"),
        allow_unmarked=kw.get("allow_unmarked", False), param_names=kw.get("param_names"),
        replicated=kw.get("replicated", ()),
    )  # fmt: skip


class NxdtExport(NxdExport):
    """An NxD tag with a Lightning ``user_content.pt`` and no ``scheduler.pt``, at a DST named by the template."""

    def __init__(self, conv: Conversion, **kw: Any) -> None:
        super().__init__(conv, **kw)
        trees = conv.trees
        self.samples = consumed_samples(trees.data_position)
        if self.samples is None:
            raise LayoutError(
                f"--format nxdt: {conv.source.path} records no data position; pass --consumed-samples N "
                "(NxD Training reads it from the tag name)"
            )
        self.name: TagName | None = None

    def begin(self, dst: str) -> Staging:
        step = self.conv.trees.step
        name = parse_tag_name(Path(dst.rstrip("/")).name)
        want = f"<run>--step={step}-consumed_samples={float(self.samples)}.ckpt"
        if name is None:
            raise CkptError(
                f"DST {dst}: NxD Training finds tags by name and reads the data position from it; name DST {want}"
            )
        if (name.step, name.consumed_samples) != (step, self.samples):
            raise CkptError(
                f"DST {dst}: the name says step={name.step} consumed_samples={name.consumed_samples}, the checkpoint "
                f"step={step} consumed_samples={self.samples}; name DST {want}"
            )
        self.name = name
        return super().begin(dst)

    def closing_files(self) -> tuple[Any, Any]:
        """No ``scheduler.pt`` (NxD Training keeps the scheduler in the Lightning dict): ``user_content.pt`` only."""
        return None, lightning_dict(self.conv)


def lightning_dict(conv: Conversion) -> dict[str, Any]:
    """The Lightning dict for ``user_content.pt`` (plain types and tensors only).

    A Lightning dict the source carried (an NxD Training tag) is kept whole when its ``global_step`` is the
    checkpoint's step.  Otherwise the keys NxD Training's restore reads are written: ``global_step`` and ``epoch``
    (``NLPCheckpointConnector.restore_loops`` sets the loops' counters from them, nlp_overrides.py:643-667) and
    ``lr_schedulers`` (``restore_optimizers_and_schedulers``, 695-715); ``loops`` is left out, since the carried
    loop counters would overwrite the step; ``pytorch-lightning_version`` is filled by the load path (551-564).
    """
    trees = conv.trees
    carried = treecodec.decode(trees.user) if trees.user is not None else None
    if is_lightning_dict(carried) and carried["global_step"] == trees.step:
        out = dict(carried)
    else:
        out = {}
        if is_lightning_dict(carried):
            out = {k: v for k, v in carried.items() if k not in ("loops", "global_step", "lr_schedulers")}
        position = trees.data_position or {}
        out["epoch"] = int(position.get("epoch") or out.get("epoch") or 0)
        out["global_step"] = trees.step
    if trees.scheduler is not None:
        out["lr_schedulers"] = [treecodec.decode(trees.scheduler)]
    else:
        out.pop("lr_schedulers", None)
    return out


def export(conv: Conversion, *, xser: bool | None = None, zero1: bool | None = None,
           storage_options: dict[str, Any] | None = None, verify: bool = True, **_: Any) -> NxdtExport:  # fmt: skip
    return NxdtExport(conv, xser=xser, zero1=zero1, storage_options=storage_options, verify=verify)


__all__ = [
    "ADAPTER",
    "NxdtExport",
    "NxdtSource",
    "TagName",
    "consumed_samples",
    "data_position",
    "detect",
    "export",
    "is_lightning_dict",
    "lightning_dict",
    "name_step",
    "open_source",
    "parse_tag_name",
    "refuse_megatron",
]
