"""optimum-neuron ``NeuronTrainer`` checkpoint folders (``checkpoint-N/``) as a conversion source and target.

What optimum-neuron 0.1-0.4 writes (its sources: ``trainers.py`` / ``trainers/transformers.py``
``NeuronTrainer._save_checkpoint`` and ``save_model``; ``models/training/modeling_utils.py``
``NeuronModelMixin.save_pretrained``; ``peft/peft_model.py``):

* at the root: ``config.json`` (+ ``generation_config.json``), ``trn_config.json`` (its ``TrainingNeuronConfig``:
  TP/PP sizes, ``kv_size_multiplier``, ``fuse_qkv``, ``use_xser``...), ``training_args.bin`` (a pickled
  ``TrainingArguments``: never unpickled here), tokenizer files, ``scheduler.pt`` (``lr_scheduler.state_dict()``),
  ``trainer_state.json`` (``TrainerState``; ``global_step`` is the step) and, up to 0.3, ``rng_state_{rank}.pth``
  (transformers' ``Trainer._save_rng_state``);
* ``shards/``: an NxD tag written by ``neuronx_distributed.trainer.save_checkpoint(dir, tag="shards", model=...,
  optimizer=..., use_xser=trn_config.use_xser)`` (``model/``, ``optim/``, ``checkpoint``, ``done``; no
  ``scheduler.pt`` / ``user_content.pt``), plus ``mp_metadata_pp_rank_P.json`` (the fused-weight transformation
  specs its ``optimum-cli neuron consolidate`` uses).  The tensor names are NxD's (``qkv_proj.weight_q|k|v`` or
  ``weight_qkv``, always-fused ``gate_up_proj``): the rules of :mod:`ckpt.layouts` read them directly.
* LoRA runs write ``adapter_{name}/adapter_config.json`` (a PEFT config, turned back to the original model's module
  names by ``to_original_peft_config_for_model``) and a tag ``adapter_{name}/adapter_shards/`` instead of
  ``shards/``: ``save_checkpoint(model=get_peft_model_state_dict(...))``, so its names are PEFT's
  (``base_model.model.`` + the fused NxD module names: ``qkv_proj.lora_B.weight_q``, ``gate_up_proj.lora_B.weight``)
  and it holds no optimizer state.  optimum-neuron's LoRA layers (``peft/tuners/lora/layer.py``) use NxD's parallel
  layers as NxD's own LoRA does (``lora_A`` shared by a fused layer's parts, ``lora_B`` column-parallel, each rank's
  fused ``lora_B`` ``[gate_r; up_r]``), so :func:`read_lora_checkpoint` reads it with NxD's LoRA layout rules into
  a PEFT adapter (``--format peft``, exact).

ZeRO-1: optimum-neuron hands NxD its ``NeuronAcceleratedOptimizer`` wrapper, so NxD's ``save_checkpoint`` (which
tests ``isinstance(optimizer, NeuronZero1Optimizer)``) does not see ZeRO-1 and writes DP rank 0's optimizer state
only.  The files say which case a folder is: ZeRO-1 dicts (``base_state`` / ``shape_info``) from every DP rank are
read as NxD's; ZeRO-1 shards of fewer DP ranks than cover each parameter are refused, naming the parameter and
the files, and never mixed with anything (``--format hf``, which holds no optimizer state, converts the weights and
says why the optimizer is left out).

The step is ``trainer_state.json``'s ``global_step`` (else ``scheduler.pt``'s ``last_epoch``), never the digits of a
folder name.  Source: an :class:`~.nxd.source.NxdTagSource` over ``shards/`` with the root's state folded in.
Target (:class:`OptimumNeuronExport`): the NxD tag export into ``DST/shards`` in the layout optimum-neuron's model
classes build (:func:`fit_flags`), ``shards/mp_metadata_pp_rank_P.json``, the root files, and the source's
``training_args.bin`` / tokenizer files (:mod:`.optimum_neuron_files`: what optimum-neuron's own readers need), the
whole folder published at once.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CkptError, LayoutError
from ckpt.format import treecodec
from ckpt.safe_unpickle import load_torch_file
from ckpt.storage.folder import FolderTxn, begin_folder

from . import optimum_neuron_files as files
from .engine import Conversion, Staging, UnitReceipt
from .engine.export import Progress
from .hf_trainer import SCHEDULER_NAME, STATE_NAME, read_rng_files, rng_file_states
from .nxd.export import NxdExport
from .nxd.source import NxdTagSource
from .nxd.xser import load_nxd_file
from .nxd.zero1 import is_zero1_dict
from .optimum_neuron_files import fit_flags
from .peft import Adapter

NAME = "optimum-neuron"
#: optimum-neuron's ``MODEL_PARALLEL_SHARDS_DIR_NAME`` / ``ADAPTER_MODEL_PARALLEL_SHARDS_DIR_NAME``
SHARDS = "shards"
ADAPTER_SHARDS = "adapter_shards"
TRN_CONFIG = "trn_config.json"
CONFIG = "config.json"
#: why an optimum-neuron folder leaves state out
#: target formats that hold no optimizer state
WEIGHTS_ONLY = frozenset({"hf"})
NOT_WRITTEN_WHY = (
    "an optimum-neuron checkpoint holds the model and optimizer in shards/, scheduler.pt, rng_state_*.pth and "
    "trainer_state.json only"
)


def _adapters(p: Path) -> list[Path]:
    return sorted(d for d in p.glob("adapter_*") if (d / ADAPTER_SHARDS).is_dir())


def is_lora_checkpoint(path: str) -> bool:
    """A NeuronTrainer LoRA ``checkpoint-N``: ``adapter_*/adapter_shards/`` tags and no ``shards/``."""
    p = Path(path)
    return _trainer_folder(path) and not (p / SHARDS / "model").is_dir() and bool(_adapters(p))


def is_adapter(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """The format table's adapter probe (:func:`is_lora_checkpoint`)."""
    return is_lora_checkpoint(path)


#: what ``get_peft_model_state_dict`` puts before a module's name
PEFT_PREFIX = "base_model.model."


def read_lora_checkpoint(
    path: str, *, config: Mapping[str, Any], adapter: str | None = None, verify: bool = True,
    allow_unmarked: bool = False,
) -> Adapter:  # fmt: skip
    """The adapter ``adapter_{adapter}/`` of a LoRA ``checkpoint-N`` (the only one when ``adapter`` is None) as a
    PEFT adapter: names without the PEFT prefix, full tensors (every stored copy compared), its PEFT config."""
    from ckpt.layouts.lora import NXD_LORA, nxd_to_adapter
    from ckpt.layouts.spec import LayoutSpec

    from .nxd.lora import _dims, _flags
    from .nxd.source import check_usable
    from .peft import check_config

    root = Path(path)
    found = _adapters(root)
    if adapter is None and len(found) != 1:
        raise LayoutError(
            f"{root}: {len(found)} adapters ({', '.join(a.name for a in found)}); convert one folder, e.g. "
            f"{found[0] / ADAPTER_SHARDS}"
        )
    adir = found[0] if adapter is None else root / f"adapter_{adapter}"
    tag = adir / ADAPTER_SHARDS
    check_usable(tag, allow_unmarked)
    from .nxd.files import scan_tag

    files = scan_tag(tag)
    if files.optim:
        raise LayoutError(
            f"{tag}/optim: optimum-neuron saves no optimizer state with an adapter; unknown files"
        )
    shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for key, f in sorted(files.model.items()):
        obj = load_nxd_file(f, files.xser, verify=verify, context=f"tp rank {key[0]}, pp rank {key[1]}")
        if not isinstance(obj, dict):
            raise CkptError(f"{f}: expected a dict of tensors, got {type(obj).__name__}")
        for name, t in obj.items():
            bare = name.removeprefix(PEFT_PREFIX)
            if not isinstance(t, torch.Tensor) or bare == name or NXD_LORA.match(bare) is None:
                raise LayoutError(
                    f"{f}: {name} is not an optimum-neuron LoRA tensor (expected {PEFT_PREFIX}<module>.lora_A|B...)"
                )
            shards.setdefault((key[0], key[1]), {})[bare] = t
    names = sorted({n for sd in shards.values() for n in sd})
    shapes = {n: tuple(sd[n].shape) for sd in shards.values() for n in sd}
    flags = _flags(names, shapes, config, files.tp_size, files.pp_size, {})
    tensors = nxd_to_adapter(shards, LayoutSpec.of(_dims(config), flags))
    cfg_file = adir / "adapter_config.json"
    peft_cfg = _json(cfg_file, "the PEFT adapter config") if cfg_file.is_file() else None
    if not isinstance(peft_cfg, dict):
        raise CkptError(
            f"{cfg_file}: no PEFT adapter config (optimum-neuron writes it next to {ADAPTER_SHARDS}/)"
        )
    check_config(peft_cfg, str(cfg_file))
    return Adapter.of_config(tensors, peft_cfg)


def detect(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """A local folder with an NxD tag ``shards/`` (or LoRA ``adapter_*/adapter_shards/``) and the Trainer's
    ``trainer_state.json`` or ``trn_config.json`` next to it."""
    p = Path(path)
    return _trainer_folder(path) and ((p / SHARDS / "model").is_dir() or bool(_adapters(p)))


def _trainer_folder(path: str) -> bool:
    p = Path(path)
    return "://" not in path and p.is_dir() and ((p / STATE_NAME).is_file() or (p / TRN_CONFIG).is_file())


def _json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise CkptError(f"{path}: cannot read {what} ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CkptError(f"{path}: {what} is not valid JSON ({e})") from None


def read_step(root: Path, scheduler: Any) -> int | None:
    """The step the folder records: ``trainer_state.json``'s ``global_step``, else the scheduler's ``last_epoch``
    (one ``lr_scheduler.step()`` per optimizer step), else None.  Two that disagree are refused."""
    state_step = sched_step = None
    f = root / STATE_NAME
    if f.is_file():
        state = _json(f, "the Trainer state")
        gs = state.get("global_step") if isinstance(state, dict) else None
        if not isinstance(gs, int) or isinstance(gs, bool) or gs < 0:
            raise CkptError(f"{f}: global_step {gs!r}, expected a step number")
        state_step = gs
    if isinstance(scheduler, dict) and isinstance(scheduler.get("last_epoch"), int):
        sched_step = int(scheduler["last_epoch"])
    if state_step is not None and sched_step is not None and state_step != sched_step:
        raise LayoutError(
            f"{root}: trainer_state.json global_step {state_step} but {SCHEDULER_NAME} last_epoch {sched_step}; "
            "the files disagree on the step (pass --step N to choose)"
        )
    return state_step if state_step is not None else sched_step


def check_zero1_files(tag: Path, xser: bool, dp_size: int, files: Mapping[Any, Path]) -> None:
    """Refuse ZeRO-1 optimizer shards that the DP files on disk cannot cover (see the module docstring).

    ``files``: ``{(dp, rank): path}`` as :func:`~.nxd.files.scan_tag` lists ``optim/``; the first rank's DP 0
    file is read (memory-mapped) for its shard and parameter shapes."""
    path = files[min(k for k in files if k[0] == 0)]  # every (tp, pp) rank is sharded over the same DP size
    d = load_nxd_file(path, xser, mmap=True)
    if not is_zero1_dict(d):
        return
    for pid, shape in d["shape_info"].items():
        numel = math.prod(int(x) for x in shape)
        for key, value in d["base_state"].get(pid, {}).items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            held = value.numel() * dp_size
            if held < numel:
                ranks = math.ceil(numel / max(value.numel(), 1))
                raise LayoutError(
                    f"{tag}/optim: ZeRO-1 optimizer shards of {dp_size} DP rank{'s' if dp_size > 1 else ''} "
                    f"({path.name}) hold {held} of the {numel} elements of pid {pid}'s {key} "
                    f"(shape {list(shape)}): the run sharded it over about {ranks} DP ranks, and optimum-neuron's "
                    "wrapped optimizer hid ZeRO-1 from NxD's save_checkpoint, which saved DP rank 0's shard only; "
                    "the optimizer state is incomplete and cannot be converted"
                )


class OptimumNeuronSource(NxdTagSource):
    """A NeuronTrainer ``checkpoint-N`` folder: the NxD tag ``shards/`` plus the Trainer state at the root."""

    format = NAME

    def __init__(self, path: str | Path, *, target_format: str | None = None, **kw: Any) -> None:
        """``kw``: :class:`NxdTagSource`'s (``config``, ``flags``, ``step``...); ``target_format``: see
        :func:`open_source`."""
        root = Path(path)
        hw = (kw.get("flags") or {}).get("hw", "trn1")
        # its loading and consolidation read one KV order on every chip (optimum_neuron_files)
        if hw != "trn1":
            raise LayoutError(
                f"{root}: --source-hw {hw}: optimum-neuron 0.4.5 stores KV copies tiled (the trn1 order) on every "
                "chip (transformations_utils.py:862); drop --source-hw"
            )
        config, step = kw.pop("config", None), kw.pop("step", None)
        adapters = _adapters(root)
        if adapters and not (root / SHARDS / "model").is_dir():
            raise LayoutError(
                f"{root}: an optimum-neuron LoRA checkpoint ({', '.join(a.name for a in adapters)}/{ADAPTER_SHARDS}); "
                "it converts to --to cuda --format peft --config BASE/config.json"
            )
        if config is None and (root / CONFIG).is_file():
            config = _json(root / CONFIG, "the model config")
        tag = root / SHARDS
        from .nxd.files import scan_tag

        files = scan_tag(tag)
        if files.optim:
            try:
                check_zero1_files(tag, files.xser, files.dp_size, files.optim)
            except LayoutError as e:
                if target_format not in WEIGHTS_ONLY:
                    raise
                # the target holds no optimizer state: the incomplete files are never read
                warnings.warn(f"{e}; converting the weights only", stacklevel=2)
        scheduler = load_torch_file(root / SCHEDULER_NAME) if (root / SCHEDULER_NAME).is_file() else None
        recorded = read_step(root, scheduler)
        if step is None and recorded is None:
            raise LayoutError(
                f"{root}: neither trainer_state.json nor {SCHEDULER_NAME} records the step; pass --step N"
            )
        super().__init__(tag, config=config, step=step if step is not None else recorded, **kw)
        self.path = str(root)
        trees = self.trees
        if scheduler is not None:
            trees.scheduler = treecodec.encode(scheduler, SCHEDULER_NAME)
        trees.rng.update(read_rng_files(root))
        if (root / STATE_NAME).is_file():
            trees.extra["hf_trainer_state"] = _json(root / STATE_NAME, "the Trainer state")
        on: dict[str, Any] = {"shards": SHARDS}
        if (root / TRN_CONFIG).is_file():
            on["trn_config"] = _json(root / TRN_CONFIG, "trn_config.json")
        trees.extra["optimum_neuron"] = on
        if self.record is not None:
            self.record = dataclasses.replace(
                self.record, source={**(self.record.source or {}), "format": NAME}
            )


#: the ``open_source`` keywords an optimum-neuron folder hands to its NxD tag (:class:`NxdTagSource`)
_TAG_OPTIONS = ("config", "step", "allow_unmarked", "verify", "param_names", "replicated")


def open_source(
    path: str, *, source_flags: Mapping[str, Any] | None = None, target_format: str | None = None, **kw: Any
) -> OptimumNeuronSource:
    """``target_format``: the format being written; one that holds no optimizer state (``hf``) converts a folder
    whose ZeRO-1 optimizer files are incomplete (with a warning), any other refuses it."""
    tag = {k: kw[k] for k in _TAG_OPTIONS if k in kw}
    return OptimumNeuronSource(path, flags=source_flags, target_format=target_format, **tag)


def _bytes_of(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def trn_config(conv: Conversion, xser: bool) -> dict[str, Any]:
    """The ``trn_config.json`` of the layout written (:func:`.optimum_neuron_files.trn_config`), over the source's
    own (an optimum-neuron source)."""
    assert conv.flags is not None
    came = conv.trees.extra.get("optimum_neuron") if isinstance(conv.trees.extra, dict) else None
    base = dict(came.get("trn_config") or {}) if isinstance(came, dict) else {}
    return files.trn_config(base, conv.flags, xser)


def stage_parameters(conv: Conversion) -> dict[int, list[str]]:
    """``{pp rank: [parameter names]}``: the model parameters each PP stage of the plan holds, in plan order."""
    out: dict[int, list[str]] = {p: [] for p in range(conv.flags.pp if conv.flags else 1)}
    for t in conv.tensors:
        if t.desc.role != "parameter":
            continue
        for pp in sorted({rank[1] for part in t.parts for rank in part.ranks}):
            out[pp].append(t.desc.name)
    return out


class OptimumNeuronExport(NxdExport):
    """A ``checkpoint-N`` folder: the NxD tag into ``shards/`` (the units are its ranks), the root files at commit.

    The folder is one transaction: a hidden staging folder holds ``shards/`` (itself written by the tag writer's
    own transaction inside it) and the root files, and is renamed into place last."""

    def __init__(self, conv: Conversion, **kw: Any) -> None:
        if kw.get("storage_options"):
            raise CkptError("--format optimum-neuron writes local folders only")
        source = (conv.record.source or {}) if conv.record is not None else {}
        if kw.get("xser") is None and "xser" not in source:
            kw["xser"] = True  # TrainingNeuronConfig.use_xser's default
        super().__init__(conv, **kw)
        self._root: FolderTxn | None = None
        from .hf import not_written

        #: what the folder cannot hold (NxD's user_content.pt, a GradScaler, data-loader state): said, never dropped
        self.not_written = not_written(
            conv,
            {t.desc.name: t for t in conv.tensors},
            frozenset({"optimizer param groups", "scheduler state", "RNG state"}),
        )

    def begin(self, dst: str) -> Staging:
        self._root = begin_folder(dst)
        try:
            return super().begin(str(Path(self._root.url) / SHARDS))
        except BaseException:
            self._root.abort()
            raise

    def write(
        self, staging: Staging, units: Sequence[int], progress: Progress = None, *, worker: int = 0
    ) -> UnitReceipt:
        return super().write(staging, units, progress, worker=worker)

    def commit(self, staging: Staging, dst: str, receipts: list[UnitReceipt]) -> str:
        if self._root is None:
            raise CkptError(f"{dst}: commit by an export that did not begin this folder")
        trees = self.conv.trees
        scheduler, user = trees.scheduler, trees.user
        # the tag keeps no scheduler or user content: optimum-neuron's save_pretrained passes neither
        trees.scheduler = trees.user = None
        try:
            super().commit(staging, str(Path(self._root.url) / SHARDS), receipts)
        finally:
            trees.scheduler, trees.user = scheduler, user
        storage = self._root.storage
        if self.conv.config is not None:
            storage.put_bytes(CONFIG, (json.dumps(self.conv.config, indent=2) + "\n").encode())
        storage.put_bytes(
            TRN_CONFIG, (json.dumps(trn_config(self.conv, self.xser), indent=4) + "\n").encode()
        )
        if self.conv.config is not None and self.conv.flags is not None:
            # what consolidation reads (checkpointing.py:138-142), as save_pretrained writes it (modeling_utils.py:1490-1497)
            for pp, names in stage_parameters(self.conv).items():
                meta = files.mp_metadata(names, self.conv.flags, self.conv.config)
                storage.put_bytes(
                    f"{SHARDS}/mp_metadata_pp_rank_{pp}.json", json.dumps(meta, indent=4).encode()
                )
        for name, path in files.side_files(getattr(self.conv.source, "path", None)).items():
            storage.put_bytes(name, path.read_bytes())  # training_args.bin: bytes only, never unpickled
        if scheduler is not None:
            storage.put_bytes(SCHEDULER_NAME, _bytes_of(treecodec.decode(scheduler)))
        rng = dict(trees.rng)
        for name, st in rng_file_states(rng).items():
            if len(rng) == 1 and name == "rng_state.pth":
                name = "rng_state_0.pth"  # NeuronTrainer runs are distributed: one file per process
            storage.put_bytes(name, _bytes_of(st))
        state = dict(trees.extra.get("hf_trainer_state") or {})
        state.setdefault("log_history", [])
        state["global_step"] = trees.step
        storage.put_bytes(STATE_NAME, (json.dumps(state, indent=2, sort_keys=True) + "\n").encode())
        self._root.commit()
        return dst

    def abort(self, staging: Staging) -> None:
        try:
            super().abort(staging)
        finally:
            if self._root is not None:
                self._root.abort()


def export(conv: Conversion, *, xser: bool | None = None, zero1: bool | None = None,
           storage_options: dict[str, Any] | None = None, verify: bool = True, **_: Any) -> OptimumNeuronExport:  # fmt: skip
    return OptimumNeuronExport(conv, xser=xser, zero1=zero1, storage_options=storage_options, verify=verify)


__all__ = [
    "NAME",
    "OptimumNeuronExport",
    "OptimumNeuronSource",
    "check_zero1_files",
    "detect",
    "is_adapter",
    "is_lora_checkpoint",
    "read_lora_checkpoint",
    "export",
    "fit_flags",
    "open_source",
    "read_step",
]
