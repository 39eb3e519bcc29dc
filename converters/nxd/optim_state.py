"""What an NxD tag's optimizer files say, described as our manifest describes an optimizer.

NxD's files record the state of each parameter and the param groups, but not the optimizer class and not one
merged view over the pipeline stages: the groups are merged over the stages' files here, the per-tensor states
become ``optimizer_state`` tensors beside their parameters, the scalars stay in the encoded tree, and the class
is inferred from the state keys (or recorded as unknown, never guessed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ckpt.errors import CorruptionError
from ckpt.format import treecodec
from ckpt.format.dtypes import dtype_name
from ckpt.format.manifest import TensorDesc
from ckpt.state.training import optim_name

from .zero1 import Deferred

#: the key of NxD's fp32 master copy of a parameter (``master_weights``), stored beside its Adam moments
MASTER_KEY = "master_weight"
ZERO1_TYPE = "neuronx_distributed.optimizer.zero_redundancy_optimizer.NeuronZero1Optimizer"
#: the optimizer class of a tag whose state does not say it
UNKNOWN = "unknown"


def merge_groups(into: list[dict[str, Any]], groups: Sequence[Mapping[str, Any]], *, where: str) -> None:
    """Union of the ranks' param groups: same hyper-parameters, parameter names in first-seen order."""
    if into and len(into) != len(groups):
        raise CorruptionError(f"{where}: ranks disagree on the number of optimizer param_groups")
    for gi, g in enumerate(groups):
        if len(into) <= gi:
            enc = {k: treecodec.encode(v, f"param_groups[{gi}].{k}") for k, v in g.items() if k != "params"}
            enc["params"] = []
            into.append(enc)
        seen = set(into[gi]["params"])
        into[gi]["params"].extend(n for n in g["params"] if n not in seen)


def infer_optimizer(keys: set[Any], groups: Sequence[Mapping[str, Any]]) -> str:
    """The optimizer class an NxD tag's state says, as ``torch.optim`` writes it; ``"unknown"`` where it does not say.

    NxD files record no class.  Adam-style moments (``exp_avg``/``exp_avg_sq``) with ``decoupled_weight_decay`` in
    every param group tell Adam from AdamW (torch >= 2.6 writes it); ``momentum_buffer`` or SGD's own hyper-parameters
    tell SGD.  Anything else is recorded as unknown rather than guessed."""

    def flag(g: Mapping[str, Any]) -> Any:
        return treecodec.decode(g["decoupled_weight_decay"]) if "decoupled_weight_decay" in g else None

    if {"exp_avg", "exp_avg_sq"} <= keys:
        decoupled = {flag(g) for g in groups}
        if decoupled == {True}:
            return "torch.optim.adamw.AdamW"
        if decoupled == {False}:
            return "torch.optim.adam.Adam"
        return UNKNOWN
    sgd_keys = {"momentum", "dampening", "nesterov"}
    if keys <= {"momentum_buffer"} and groups and all(sgd_keys <= set(g) for g in groups):
        return "torch.optim.sgd.SGD"
    return UNKNOWN


def describe_optimizer(
    stages: Iterable[Mapping[str, Any] | None], tensors: dict[str, TensorDesc], *, zero1: bool, where: str
) -> tuple[dict[str, Any] | None, Any]:
    """The encoded optimizer tree and NxD's extra keys of a tag, from the optimizer of each PP stage's first rank
    (``stages``, read one at a time; None for a stage without one); every per-tensor state is added to ``tensors``
    as an ``optimizer_state`` of its parameter, partitioned as the parameter is.  (None, None) without optimizer."""
    groups: list[dict[str, Any]] = []
    scalars: dict[str, dict[str, Any]] = {}
    seen = False
    extra: Any = None
    for opt in stages:
        if opt is None:
            continue
        seen = True
        merge_groups(groups, opt["param_groups"], where=where)
        states = {
            (n, key): v
            for n, per in opt["state"].items()
            for key, v in per.items()
            if isinstance(v, (torch.Tensor, Deferred)) and v.dim() > 0 and key != "step"
        }
        for n, w in (opt.get("master_weights") or {}).items():
            states[(n, MASTER_KEY)] = w
        for (n, key), v in states.items():
            if n not in tensors:
                raise CorruptionError(f"{where}: optimizer state for {n!r}, which is not a model tensor")
            param = tensors[n]
            oname = optim_name(n, key)
            tensors.setdefault(
                oname,
                TensorDesc(
                    oname, "optimizer_state", param.shape, dtype_name(v.dtype), n, key, param.partition
                ),
            )
        for n, per in opt["state"].items():
            for key, v in per.items():
                if (n, key) not in states:
                    scalars.setdefault(n, {}).setdefault(
                        key, treecodec.encode(v, f"optimizer state {n}.{key}")
                    )
        if opt.get("extra") and extra is None:
            extra = treecodec.encode(opt["extra"], "optimizer extra")
    if not seen:
        return None, None
    keys = {d.key for d in tensors.values() if d.role == "optimizer_state" and d.key != MASTER_KEY}
    for per in scalars.values():
        keys.update(per)
    inner = infer_optimizer(keys, groups)
    if zero1:
        return {"type": ZERO1_TYPE, "base": inner, "param_groups": groups, "state": scalars}, extra
    return {"type": inner, "param_groups": groups, "state": scalars}, extra
