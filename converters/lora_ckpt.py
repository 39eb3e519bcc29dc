"""A LoRA adapter (NxD LoRA tag with its optimizer state when it has one, or PEFT folder) -> an adapter-only
checkpoint of ours, shaped exactly as ``save(model=peft_model, optimizer=opt, adapter_only=True)`` writes one, so
that ``restore(path, model=peft_model, optimizer=opt)`` resumes the run on a GPU with its moments.

Tensor names are the ``PeftModel``'s parameter names (``base_model.model.<module>.lora_A.<adapter>.weight``, adapter
``default``, what ``PeftModel.from_pretrained`` names it).  Where NxD keeps one matrix for several HF modules (q/k/v
``lora_A`` of ``qkv_proj``, gate/up ``lora_A``) each PEFT parameter gets its own copy of the matrix and of its state,
as PEFT holds them.  The optimizer's class is recorded as ``unknown`` (an NxD optim file does not say).

The base is not identified by these sources, so ``adapter.base.digest`` is null: restore warns that it did not
check the base instead of refusing (docs/format.md, "Adapter checkpoints").  The step is ``--step``, else the one the
NxD tag records; a source that records none (a PEFT folder) is refused.  An adapter checkpoint of ours is refused as
a source (it is the format already, and a copy would lose its base identity).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckpt.errors import CkptError, LayoutError
from ckpt.saving.options import SaveOptions
from ckpt.state.adapters import BaseIdentity

from . import peft

ADAPTER_NAME = "default"
#: where an adapter checkpoint written from a Trainer folder keeps its ``trainer_state.json`` (``extra``), as a
#: full Trainer folder's conversion does
TRAINER_STATE_KEY = "hf_trainer_state"


def peft_param_name(hf: str, adapter: str = ADAPTER_NAME) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A.weight`` -> the PeftModel parameter holding it."""
    mod, ab, leaf = hf.rsplit(".", 2)
    return f"{peft.PREFIX}{mod}.{ab}.{adapter}.{leaf}"


class _Holder(torch.nn.Module):
    """The adapter's tensors under PeftModel's names, trainable, with the PEFT config where ``lora_config`` reads it."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], peft_config: dict[str, Any]) -> None:
        super().__init__()
        for name, t in tensors.items():
            *path, leaf = name.split(".")
            mod: torch.nn.Module = self
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, torch.nn.Module())
                mod = mod._modules[part]  # type: ignore[assignment]
            mod.register_parameter(leaf, torch.nn.Parameter(t.detach(), requires_grad=True))
        self.peft_config = {ADAPTER_NAME: _Config(peft_config)}
        self.active_adapter = ADAPTER_NAME


class _Config:
    def __init__(self, d: dict[str, Any]) -> None:
        self._d = d

    def to_dict(self) -> dict[str, Any]:
        return dict(self._d)


class _Optimizer:
    """torch.optim's ``param_groups`` / ``state_dict`` over the holder's parameters, for the saver's capture."""

    def __init__(self, optimizer: Mapping[str, Any], params: Mapping[str, torch.nn.Parameter]) -> None:
        order = [n for g in optimizer["param_groups"] for n in g["params"]]
        pid = {n: i for i, n in enumerate(order)}
        self.param_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [params[n] for n in g["params"]]}
            for g in optimizer["param_groups"]
        ]
        self._sd = {
            "state": {pid[n]: dict(s) for n, s in optimizer["state"].items()},
            "param_groups": [
                {**{k: v for k, v in g.items() if k != "params"}, "params": [pid[n] for n in g["params"]]}
                for g in optimizer["param_groups"]
            ],
        }

    def state_dict(self) -> dict[str, Any]:
        return self._sd


class _NoBase:
    def __init__(self, identity: BaseIdentity) -> None:
        self._identity = identity

    def identity(self, model: Any, source: str | None = None) -> BaseIdentity:
        return self._identity


def write_ckpt_adapter(
    adapter: peft.Adapter,
    dst: str,
    *,
    step: int,
    source: str,
    config: dict[str, Any] | None,
    storage_options: dict[str, Any] | None = None,
    codec: str = "raw",
) -> int:
    """Write ``adapter`` (and its optimizer state) as an adapter-only checkpoint at ``dst``; returns bytes written."""
    from ckpt.saving.checkpointer import Checkpointer
    from ckpt.state.training import optimizer_capture

    names = {h: peft_param_name(h) for h in adapter.tensors}
    holder = _Holder({names[h]: t for h, t in adapter.tensors.items()}, adapter.to_peft_config())
    params = dict(holder.named_parameters())
    opt = None
    if adapter.optimizer is not None:
        state = adapter.optimizer["state"]
        grouped = [n for g in adapter.optimizer["param_groups"] for n in g["params"]]
        if sorted(grouped) != sorted(adapter.tensors) or len(set(grouped)) != len(grouped):
            raise LayoutError(f"{source}: the optimizer's param groups do not hold each adapter tensor once")
        opt = _Optimizer(
            {
                "state": {names[h]: s for h, s in state.items()},
                "param_groups": [
                    {**g, "params": [names[h] for h in g["params"]]}
                    for g in adapter.optimizer["param_groups"]
                ],
            },
            params,
        )

    training = adapter.training
    rng = dict(training.rng) if training is not None else {}
    if len(rng) > 1:
        raise LayoutError(f"{source}: RNG state of {len(rng)} ranks; an adapter checkpoint of one rank holds one")

    class _Writer(Checkpointer):
        def capture_optimizer(self, optimizer: Any, model: Any) -> tuple[list[Any], dict[str, Any]]:
            tensors, meta = optimizer_capture(optimizer, model)
            return tensors, {**meta, "type": "unknown"}

        def capture_rng(self) -> dict[str, Any]:  # the Trainer's streams, not this process's
            return next(iter(rng.values()))

    extra = {TRAINER_STATE_KEY: training.trainer_state} if training is not None and training.trainer_state else None
    scheduler = _StateDict(training.scheduler) if training is not None and training.scheduler is not None else None
    saver = _Writer(async_save=False, storage_options=storage_options, codec=codec)
    saver._base = _NoBase(BaseIdentity(None, 0, 0, config, None))  # type: ignore[arg-type]
    try:
        res = saver.save(
            dst, step=step, model=holder, optimizer=opt, scheduler=scheduler,
            options=SaveOptions(rng=bool(rng), adapter_only=True, extra=extra),
        ).result()  # fmt: skip
    finally:
        saver.close()
    return int(res.bytes_written)


class _StateDict:
    """A scheduler's saved state, as the saver captures a live scheduler (``state_dict()``)."""

    def __init__(self, sd: dict[str, Any]) -> None:
        self._sd = sd

    def state_dict(self) -> dict[str, Any]:
        return self._sd


def read_training(reader: Any) -> peft.Training | None:
    """The training state an adapter checkpoint of ours keeps (written from a Trainer folder): the step, the
    scheduler, rank 0's RNG streams and the Trainer's state; None when it has no scheduler and no Trainer state."""
    from ckpt.format import treecodec

    m = reader.manifest
    trainer_state = m.extra.get(TRAINER_STATE_KEY)
    if m.scheduler is None and not isinstance(trainer_state, dict):
        return None
    rng, _ = reader.rank_trees(0)
    return peft.Training(
        int(m.step),
        treecodec.decode(m.scheduler) if m.scheduler is not None else None,
        {"0": rng} if rng is not None else {},
        dict(trainer_state) if isinstance(trainer_state, dict) else {},
    )


def ckpt_step(src: str, explicit: int | None, recorded: int | None) -> int:
    """The step to record: ``--step``, else the source's own; refused when neither says."""
    if explicit is not None:
        return explicit
    if recorded is None:
        raise CkptError(f"--step: {src} records no step; pass --step N for the checkpoint")
    return recorded


__all__ = ["ADAPTER_NAME", "TRAINER_STATE_KEY", "ckpt_step", "peft_param_name", "read_training", "write_ckpt_adapter"]
