"""Turning training objects into logical tensors and JSON trees, and back.

The core never sees a model or an optimizer: this module flattens them into named tensors (parameters, buffers,
optimizer moments keyed by *parameter name*, never positional id) and encoded trees (param_groups, scheduler,
scaler, data-loader state), and maps them back for a restore.  Positional optimizer ids are what break
resharding and model edits in other tools; names survive both.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import StateMismatchError
from ..format import treecodec
from ..format.schema import Box

OPTIM_PREFIX = "optim/"


@dataclass(frozen=True)
class NamedTensor:
    name: str
    tensor: torch.Tensor
    role: str
    param: str | None = None
    key: str | None = None


def optim_name(param: str, key: str) -> str:
    return f"{OPTIM_PREFIX}{param}/{key}"


# The model of the save being captured and its parameters, every name of every parameter (tied ones under each
# name), walked once: a save asks for them three times (model or adapter tensors, the frozen base's identity, the
# optimizer's parameter names), and on a PEFT model each walk of its thousand modules costs about half a
# millisecond of the training thread at every save.
_WALK: ContextVar[tuple[Any, list[tuple[str, torch.nn.Parameter]]] | None] = ContextVar(
    "ckpt_walk", default=None
)


@contextmanager
def one_walk(model: Any) -> Iterator[None]:
    """Within the block, :func:`all_named_parameters` and :func:`named_parameters` of ``model`` reuse one walk.

    Only for the span of one capture, in which nothing adds or removes parameters: a model edited between two
    saves is walked again by the next."""
    walked = (
        (model, list(model.named_parameters(remove_duplicate=False)))
        if isinstance(model, torch.nn.Module)
        else None
    )
    token = _WALK.set(walked)
    try:
        yield
    finally:
        _WALK.reset(token)


def all_named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``model.named_parameters(remove_duplicate=False)``: a parameter shared by several modules under each name."""
    walked = _WALK.get()
    if walked is not None and walked[0] is model:
        return walked[1]
    return list(model.named_parameters(remove_duplicate=False))


def named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``model.named_parameters()``: each parameter once, under the first name the module walk meets (the same
    walk in the same order, so the first occurrence of each parameter is the name the deduplicating walk gives)."""
    walked = _WALK.get()
    if walked is None or walked[0] is not model:
        return list(model.named_parameters())
    seen: set[int] = set()
    out = []
    for n, p in walked[1]:
        if id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out


def model_tensors(model: Any) -> list[NamedTensor]:
    """Parameters and buffers of an ``nn.Module`` (via ``state_dict``), or every tensor of a flat state dict."""
    if isinstance(model, torch.nn.Module):
        params = {n for n, _ in named_parameters(model)}
        sd = model.state_dict()
        return [
            NamedTensor(n, t, "parameter" if n in params else "buffer")
            for n, t in sd.items()
            if isinstance(t, torch.Tensor)
        ]
    if isinstance(model, Mapping):
        out = []
        for n, t in model.items():
            if not isinstance(t, torch.Tensor):
                raise StateMismatchError(
                    f"model state dict entry {n!r} is a {type(t).__name__}, expected a tensor"
                )
            out.append(NamedTensor(str(n), t, "parameter"))
        return out
    raise StateMismatchError(f"model must be an nn.Module or a state dict, got {type(model).__name__}")


def param_names_in_optimizer_order(optimizer: torch.optim.Optimizer, model: Any) -> list[str]:
    """Names of the optimizer's parameters in its own (state_dict id) order."""
    if not isinstance(model, torch.nn.Module):
        raise StateMismatchError(
            "saving or restoring an optimizer needs model= as an nn.Module to name its parameters"
        )
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not callable(getattr(optimizer, "state_dict", None)):
        raise StateMismatchError(
            f"optimizer= is a {type(optimizer).__name__}, not an optimizer (no param_groups/state_dict); "
            "pass the torch.optim.Optimizer (model= takes the module)"
        )
    by_id = {id(p): n for n, p in all_named_parameters(model)}
    names = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in by_id:
                raise StateMismatchError(
                    f"optimizer param_groups[{gi}] parameter {pi} (shape {list(p.shape)}) is not a parameter of the model"
                )
            names.append(by_id[id(p)])
    return names


def optimizer_capture(
    optimizer: torch.optim.Optimizer, model: Any
) -> tuple[list[NamedTensor], dict[str, Any]]:
    """Optimizer moments as named tensors, plus the JSON part (type, param_groups by name, scalar state)."""
    names = param_names_in_optimizer_order(optimizer, model)
    sd = optimizer.state_dict()
    tensors: list[NamedTensor] = []
    scalars: dict[str, Any] = {}
    for idx, per_param in sd["state"].items():
        pname = names[idx]
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors.append(NamedTensor(optim_name(pname, key), value, "optimizer_state", pname, key))
            else:
                scalars.setdefault(pname, {})[key] = treecodec.encode(
                    value, f"optimizer.state[{pname}].{key}"
                )
    return tensors, optimizer_meta(optimizer, sd["param_groups"], names, scalars)


def optimizer_meta(
    optimizer: Any, param_groups: list[dict[str, Any]], names: list[str], scalars: dict[str, Any]
) -> dict[str, Any]:
    """The manifest's ``optimizer`` object: class, param_groups with parameter names, encoded scalar state."""
    groups = []
    for gi, g in enumerate(param_groups):
        enc = {
            k: treecodec.encode(v, f"optimizer.param_groups[{gi}].{k}") for k, v in g.items() if k != "params"
        }
        enc["params"] = [names[i] for i in g["params"]]
        groups.append(enc)
    cls = type(optimizer)
    return {"type": f"{cls.__module__}.{cls.__qualname__}", "param_groups": groups, "state": scalars}


def state_dict_of(obj: Any, what: str) -> Any:
    if obj is None:
        return None
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        return dict(obj)
    raise StateMismatchError(f"{what} of type {type(obj).__name__} has no state_dict()")


def load_state_into(obj: Any, state: Any, what: str) -> None:
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(state)
    elif isinstance(obj, dict):
        obj.clear()
        obj.update(state)
    else:
        raise StateMismatchError(f"{what} of type {type(obj).__name__} has no load_state_dict()")


def is_dtensor(t: Any) -> bool:
    """``isinstance(t, DTensor)`` without importing ``torch.distributed.tensor`` (a tenth of a second at start-up,
    and an import lookup per call in per-tensor loops): no tensor is a DTensor before that module is imported."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def local_box(t: torch.Tensor) -> tuple[tuple[int, ...], Box, torch.Tensor]:
    """(global shape, box held locally, local tensor) for a plain tensor or a DTensor."""
    if is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        from torch.distributed.tensor.placement_types import Replicate, Shard

        for pl in t.placements:
            if not isinstance(pl, (Replicate, Shard)) or type(pl) not in (Replicate, Shard):
                raise StateMismatchError(
                    f"DTensor placement {pl} is not supported (only Shard and Replicate); call full_tensor() "
                    "or redistribute before saving"
                )
        shape = tuple(t.shape)
        local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        return shape, Box(tuple(offset), tuple(local_shape)), local
    shape = tuple(t.shape)
    return shape, Box.full(shape), t
