"""Saving and restoring NxD / torch-xla training state: the core checkpointer with Neuron's layout and transfers.

Same API as :class:`ckpt.Checkpointer` / :func:`ckpt.restore` / :class:`ckpt.CheckpointManager`.  What differs:

* staging: one graph sync and one batched device->host transfer per save (:class:`~.stager.XlaStager`);
* layout: every TP shard is placed in its logical tensor (:class:`~.partition.NxdLayout`), the manifest says
  ``backend="neuron"`` (on XLA), ``layout.kind="nxd"`` with the TP/PP/DP/EP sizes, and ``extra.nxd`` carries what
  a converter needs without model code (rule set, kv_size_multiplier, hw, fuse_qkv, qkv_linear, virtual_pp,
  config, and with PP the PP ranks of every tensor);
* ZeRO-1 optimizers are saved merged by parameter name (:mod:`.zero1`);
* restore reads every tensor of this rank to the host first and uploads them to the XLA device in one batch.

XLA seed and NxD RNG tracker are recorded by :mod:`ckpt.state.rng` whenever torch_xla is imported.
"""

from __future__ import annotations

import dataclasses
import re
from concurrent.futures import Future
from typing import Any

import torch

from ckpt.errors import StateMismatchError
from ckpt.format.dtypes import dtype_from_name
from ckpt.format.manifest import Layout
from ckpt.layouts.families import rule_set_for_config
from ckpt.layouts.record import NxdRecord
from ckpt.manager import CheckpointManager
from ckpt.restoring.loader import Restorer, RestoreResult
from ckpt.restoring.loader import restore as core_restore
from ckpt.saving.checkpointer import Checkpointer, SaveResult
from ckpt.saving.options import SaveOptions
from ckpt.state.training import NamedTensor, model_tensors, param_names_in_optimizer_order

from .parallel import ParallelInfo
from .partition import NxdLayout
from .stager import XlaStager
from .stages import merge_stage_optimizers, stage_tensors
from .transfer import is_xla, sync, to_device
from .zero1 import capture_zero1, is_zero1_optimizer, restore_zero1

_QKV_LINEAR = re.compile(r"\.qkv_proj\.(weight|bias)_(q|k|v|qkv)$")
_FUSED_QKV = re.compile(r"\.qkv_proj\.(weight|bias)(_qkv)?$")


def _hf_config(model: Any) -> dict[str, Any] | None:
    cfg = getattr(model, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    if to_dict is None:
        return None
    from ckpt.format import treecodec

    try:
        return treecodec.decode(treecodec.encode(to_dict(), "config"))
    except Exception:  # noqa: BLE001 - a config we cannot encode is recorded as unknown, not a failed save
        return None


class NeuronCheckpointer(Checkpointer):
    """A :class:`~ckpt.saving.checkpointer.Checkpointer` for NxD / torch-xla training (construct on every rank).

    Args:
        parallel: this process's ranks and sizes; default ``ParallelInfo.detect(**parallel_args)`` (NxD's
            parallel state when importable, explicit ``tp_rank=``/``tp_size=``/... otherwise).  The sizes must
            multiply to the process group's size; several ranks with neither NxD state nor sizes are refused.
        rule_set: layout rules for parameters without NxD TP attributes; ``"auto"`` (default): the rule set of the
            config's ``model_type`` family (``nxd-qwen3`` for Qwen3, ...), ``"nxd-llama"`` without a config or for
            a model type ckpt has no family for; None: replicated.
        kv_size_multiplier, hw, virtual_pp: NxD flags recorded in ``extra.nxd`` for converters.
        fuse_qkv, qkv_linear: recorded too; None infers them from the parameter names.
        config: the Hugging Face ``config.json`` dict; default ``model.config.to_dict()`` when the model has one.
        replicated: globs of parameters that have no NxD attributes and that the rule set does not know, which are
            replicated on every TP rank (recorded in ``extra.nxd``); with TP > 1 any other such parameter is refused.
        The remaining keywords go to :class:`~ckpt.saving.checkpointer.Checkpointer` (``async_save``, ``process_group``, ...).
    """

    def __init__(
        self,
        *,
        parallel: ParallelInfo | None = None,
        rule_set: str | None = "auto",
        kv_size_multiplier: int = 1,
        hw: str = "trn1",
        virtual_pp: int = 1,
        fuse_qkv: bool | None = None,
        qkv_linear: bool | None = None,
        config: dict[str, Any] | None = None,
        replicated: tuple[str, ...] | list[str] = (),
        stager: Any = None,
        layout_hook: Any = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        pp_rank: int | None = None,
        pp_size: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        ep_rank: int | None = None,
        ep_size: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__(stager=stager or XlaStager(), **options)
        self.parallel = ParallelInfo.for_world(
            self.coll.world_size, parallel, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
            dp_rank=dp_rank, dp_size=dp_size, ep_rank=ep_rank, ep_size=ep_size,
        )  # fmt: skip
        self.rule_set = rule_set
        self.replicated = tuple(replicated)
        self.flags = {"kv_size_multiplier": kv_size_multiplier, "hw": hw, "virtual_pp": virtual_pp}
        self.fuse_qkv, self.qkv_linear, self.config = fuse_qkv, qkv_linear, config
        self._fixed_hook = layout_hook
        self._layouts: dict[int, NxdLayout] = {}
        self._pp_key: tuple[str, ...] | None = None
        self._pp_ranks: dict[str, list[int]] | None = None

    def layout_for(self, model: Any) -> NxdLayout:
        """The layout hook for ``model`` (cached per model object)."""
        if self._fixed_hook is not None:
            return self._fixed_hook
        key = id(model)
        if key not in self._layouts:
            self._layouts[key] = NxdLayout(model, self.parallel, self._rule_set(model), self.replicated)
        return self._layouts[key]

    def save(
        self,
        path: str,
        *,
        step: int,
        model: Any = None,
        optimizer: Any = None,
        options: SaveOptions | None = None,
        **state: Any,
    ) -> Future:
        """As :meth:`Checkpointer.save`; ``options.layout`` and ``options.extra`` default to the Neuron ones."""
        opts = options if options is not None else SaveOptions()
        layout = self.layout_for(model)
        layout.zero1_rows.clear()
        self.layout_hook = layout
        zero = optimizer is not None and is_zero1_optimizer(optimizer)
        p = self.parallel
        if opts.layout is None:
            opts = dataclasses.replace(opts, layout=Layout(
                world_size=self.coll.world_size, tp=p.tp_size, pp=p.pp_size, dp=p.dp_size, ep=p.ep_size,
                zero_stage=1 if zero else 0, kind="nxd",
            ))  # fmt: skip
        if opts.extra is None:
            opts = dataclasses.replace(opts, extra={"nxd": self.nxd_extra(model)})
        layout.pp_ranks = self._pp_ranks if p.pp_size > 1 else None
        return super().save(path, step=step, model=model, optimizer=optimizer, options=opts, **state)

    def nxd_extra(self, model: Any) -> dict[str, Any]:
        """``extra.nxd`` of the manifest (collective when PP > 1: PP ranks of every tensor are gathered)."""
        names = [nt.name for nt in model_tensors(model)] if model is not None else []
        qkv_linear = (
            self.qkv_linear if self.qkv_linear is not None else any(_QKV_LINEAR.search(n) for n in names)
        )
        fuse = self.fuse_qkv
        if fuse is None:
            fuse = any(_FUSED_QKV.search(n) and not re.search(r"_(q|k|v)$", n) for n in names)
        record = NxdRecord(
            rule_set=self._rule_set(model),
            **self.flags,
            fuse_qkv=bool(fuse),
            qkv_linear=bool(qkv_linear),
            config=self.config if self.config is not None else _hf_config(model),
            pp_ranks=self._gather_pp_ranks(tuple(names)) if self.parallel.pp_size > 1 else None,
            replicated=self.replicated,
        )
        return record.to_extra()

    def _rule_set(self, model: Any) -> str | None:
        config = self.config if self.config is not None else _hf_config(model)
        return resolve_rule_set(self.rule_set, config)

    def _gather_pp_ranks(self, names: tuple[str, ...]) -> dict[str, list[int]]:
        if names != self._pp_key or self._pp_ranks is None:
            gathered = self.coll.all_gather((self.parallel.pp_rank, names))
            ranks: dict[str, set[int]] = {}
            for pp, ns in gathered:
                for n in ns:
                    ranks.setdefault(n, set()).add(pp)
            self._pp_ranks = {n: sorted(r) for n, r in sorted(ranks.items())}
            self._pp_key = names
        return self._pp_ranks

    def check_state(self, named: list[NamedTensor]) -> None:
        """Model tensors whose TP split neither NxD's attributes nor the rule set say are refused (TP > 1)."""
        if isinstance(self.layout_hook, NxdLayout):
            self.layout_hook.check([nt.name for nt in named if nt.role != "optimizer_state"])

    def capture_optimizer(self, optimizer: Any, model: Any) -> tuple[list[NamedTensor], dict[str, Any]]:
        """This rank's optimizer tensors; its record merged over the PP stages (collective when PP > 1)."""
        if is_zero1_optimizer(optimizer):
            assert isinstance(self.layout_hook, NxdLayout)
            tensors, meta = capture_zero1(optimizer, model, self.layout_hook)
        else:
            tensors, meta = super().capture_optimizer(optimizer, model)
        if self.parallel.pp_size > 1:
            meta = merge_stage_optimizers(self.coll.all_gather((self.parallel.pp_rank, meta)))
        return tensors, meta


class NeuronRestorer(Restorer):
    """A :class:`~ckpt.restoring.loader.Restorer` that uploads to XLA in batches and fills ZeRO-1 optimizers.

    Model tensors are read to host buffers and uploaded in one call per ``batch_bytes`` (bounding host memory).
    """

    batch_bytes = 1 << 30

    def __init__(self, reader: Any, layout_hook: Any = None) -> None:
        super().__init__(reader, layout_hook)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_bytes = 0
        self._prefetched: dict[str, torch.Tensor] = {}

    def read_into(self, name: str, box: Any, local: torch.Tensor) -> None:
        if not is_xla(local):
            super().read_into(name, box, local)
            return
        tmp = torch.empty(box.lengths, dtype=dtype_from_name(self.reader.entry(name).dtype))
        self.reader.read_box_into(name, box, tmp)
        self._pending.append((local, tmp))
        self._pending_bytes += tmp.numel() * tmp.element_size()
        if self._pending_bytes >= self.batch_bytes:
            self.flush()

    def flush(self) -> None:
        """Upload everything read for XLA tensors in one batch, then copy on the device and sync."""
        if not self._pending:
            return
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        placed = to_device([h for _, h in pending], pending[0][0].device)
        with torch.no_grad():
            for (local, _), dev in zip(pending, placed, strict=True):
                local.copy_(dev)
        sync()

    def model(self, model: Any, strict: bool) -> tuple[list[str], list[str]]:
        """As the core restorer; under PP a stage's model holds only its stage's tensors, so the tensors that
        ``extra.nxd.pp_ranks`` places on other stages are not "unexpected" (a strict restore still refuses any
        tensor this stage should hold and does not, or holds and the checkpoint lacks)."""
        stage = self._stage_tensors()
        missing, unexpected = super().model(model, strict and stage is None)
        self.flush()
        if stage is not None:
            unexpected = [n for n in unexpected if n in stage]
            if strict and (missing or unexpected):
                parts = [f"missing from checkpoint: {', '.join(missing[:8])}"] if missing else []
                if unexpected:
                    parts.append(f"held by this PP stage but not in the model: {', '.join(unexpected[:8])}")
                raise StateMismatchError(
                    f"{self.reader.path}: model does not match the checkpoint: {'; '.join(parts)}"
                )
        return missing, unexpected

    def _stage_tensors(self) -> set[str] | None:
        """Names of the tensors this rank's PP stage holds (None: no PP, or stages unknown)."""
        hook = self.layout_hook
        return stage_tensors(self.reader.manifest, hook.parallel) if isinstance(hook, NxdLayout) else None

    def held_params(self) -> set[str] | None:
        """Under PP, the parameters of this rank's stage: the others' optimizer state is theirs to restore."""
        return self._stage_tensors()

    def optimizer(self, optimizer: Any, model: Any) -> None:
        if is_zero1_optimizer(optimizer):
            if not isinstance(self.layout_hook, NxdLayout):
                raise StateMismatchError("restoring a ZeRO-1 optimizer needs the Neuron layout hook")
            restore_zero1(self.reader, self.layout_hook, optimizer, model)
            return
        self._prefetch(optimizer, model)
        super().optimizer(optimizer, model)

    def _prefetch(self, optimizer: Any, model: Any) -> None:
        """Read this rank's box of every optimizer state and upload the XLA-bound ones in one batch."""
        m = self.reader.manifest
        params = dict(model.named_parameters(remove_duplicate=False))
        wanted = set(param_names_in_optimizer_order(optimizer, model))
        host: dict[str, torch.Tensor] = {}
        device = None
        for n, e in m.tensors.items():
            if e.role != "optimizer_state" or e.param not in wanted or e.key is None:
                continue
            param = params[e.param]
            hooked = (
                self.layout_hook(NamedTensor(n, param, "optimizer_state", e.param, e.key))
                if self.layout_hook
                else None
            )
            if hooked is None:
                if tuple(param.shape) != e.shape:
                    continue  # core path decides (it reads the whole tensor)
                from ckpt.format.manifest import Box

                shape, box = e.shape, Box.full(e.shape)
            else:
                shape, box = hooked[0], hooked[1]
            if tuple(shape) != e.shape:
                raise StateMismatchError(
                    f"tensor {n!r}: checkpoint has shape {list(e.shape)}, the live layout implies {list(shape)}"
                )
            buf = torch.empty(box.lengths, dtype=dtype_from_name(e.dtype))
            self.reader.read_box_into(n, box, buf)
            host[n] = buf
            device = device or param.device
        if host:
            names = list(host)
            self._prefetched = dict(zip(names, to_device([host[n] for n in names], device), strict=True))

    def _optimizer_tensor(self, ename: str, param: torch.Tensor) -> torch.Tensor:
        if ename in self._prefetched:
            return self._prefetched.pop(ename)
        return super()._optimizer_tensor(ename, param)


def resolve_rule_set(rule_set: str | None, config: dict[str, Any] | None) -> str | None:
    """``rule_set`` itself, or for ``"auto"`` the rule set of ``config``'s model family (``nxd-llama`` when the config
    is unknown or names no family ckpt has: what every save used before families existed)."""
    return rule_set_for_config(config) if rule_set == "auto" else rule_set


def restore(
    path: Any,
    *,
    model: Any = None,
    optimizer: Any = None,
    parallel: ParallelInfo | None = None,
    rule_set: str | None = "auto",
    replicated: tuple[str, ...] | list[str] = (),
    config: dict[str, Any] | None = None,
    **kw: Any,
) -> RestoreResult:
    """:func:`ckpt.restore` for NxD / torch-xla state (same keywords; ``parallel``, ``rule_set``, ``replicated`` and
    ``config`` as in NeuronCheckpointer)."""
    rule_set = resolve_rule_set(rule_set, config if config is not None else _hf_config(model))
    layout = (
        NxdLayout(model, parallel or ParallelInfo.detect(), rule_set, replicated)
        if model is not None
        else None
    )
    kw.setdefault("layout_hook", layout)
    return core_restore(path, model=model, optimizer=optimizer, restorer=NeuronRestorer, **kw)


class NeuronCheckpointManager(CheckpointManager):
    """:class:`~ckpt.manager.CheckpointManager` whose saves and restores use the Neuron checkpointer/restorer.

    Neuron keywords (``parallel``, ``rule_set``, ``kv_size_multiplier``, ``hw``, ``tp_rank``, ...) go to
    :class:`NeuronCheckpointer`; the rest as for the core manager.
    """

    _NEURON_KEYS = (
        "parallel", "rule_set", "kv_size_multiplier", "hw", "virtual_pp", "fuse_qkv", "qkv_linear", "config",
        "replicated",
        "tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank", "dp_size", "ep_rank", "ep_size",
    )  # fmt: skip

    def __init__(self, root: str, **kw: Any) -> None:
        neuron = {k: kw.pop(k) for k in self._NEURON_KEYS if k in kw}
        super().__init__(root, **kw)
        core = self.checkpointer
        self.checkpointer = NeuronCheckpointer(
            async_save=core.async_save,
            process_group=core.coll.group,
            chunk_bytes=core.chunk_bytes,
            codec=core.codec,
            storage_options=core.storage_options,
            verify_replicas=core.verify_replicas,
            **neuron,
        )
        self.coll = self.checkpointer.coll

    def _restore_state(self, state: dict[str, Any]) -> dict[str, Any]:
        assert isinstance(self.checkpointer, NeuronCheckpointer)
        self.layout_hook = (
            self.checkpointer.layout_for(state["model"]) if state.get("model") is not None else None
        )
        state.setdefault("restorer", NeuronRestorer)
        return state

    def restore(self, step: int, **state: Any) -> RestoreResult:
        return super().restore(step, **self._restore_state(state))

    def restore_latest(self, **state: Any) -> int | None:
        return super().restore_latest(**self._restore_state(state))


__all__ = ["NeuronCheckpointManager", "NeuronCheckpointer", "NeuronRestorer", "SaveResult", "restore"]
