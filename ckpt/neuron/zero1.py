"""ZeRO-1 optimizer state (torch_xla ``ZeroRedundancyOptimizer``, NxD ``NeuronZero1Optimizer``) by parameter name.

``state_dict()`` of these wrappers holds this DP rank's shard of every state (``base_state[pid][key]``, the
TP-local tensor zero-padded on dim 0 to a multiple of the DP size, then ``chunk(dp)[dp_rank]``), ``shape_info``
(TP-local shapes), optional ``sharded_master_weights`` and ``param_groups`` keyed by pid.  Positional pids break
as soon as the grouping or the DP size changes, so each shard is saved as a *box* of its logical tensor
(padding dropped): the checkpoint holds the merged state, and a restore on any DP size reads back exactly its
own rows.  Master weights become ``optim/<name>/master_weight``.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt.errors import StateMismatchError
from ckpt.format import treecodec
from ckpt.format.dtypes import dtype_from_name
from ckpt.format.manifest import Box
from ckpt.layouts import zero1
from ckpt.state.training import NamedTensor, optim_name, optimizer_meta, param_names_in_optimizer_order
from ckpt.words import count

from .partition import NxdLayout
from .stages import stage_tensors
from .transfer import is_xla, to_device, to_host

MASTER_KEY = "master_weight"


def is_zero1_optimizer(optimizer: Any) -> bool:
    """True for torch_xla's ZeroRedundancyOptimizer and wrappers built on it (NxD NeuronZero1Optimizer)."""
    return hasattr(optimizer, "base_optimizer") and hasattr(optimizer, "get_shape_info")


def dp_of(optimizer: Any, layout: NxdLayout | None = None) -> tuple[int, int]:
    """(DP rank, DP size) the optimizer shards over: its sharding group (``local_rank`` / ``local_world_size``,
    which NxD sets to the DP group), checked against the layout's DP ranks; a wrapper without them takes the layout's.

    Never a silent ``(0, 1)``: a wrong DP size would misplace every shard's rows, so a wrapper that does not say and a
    layout that does not know (or a disagreement between the two) is refused."""
    rank, size = getattr(optimizer, "local_rank", None), getattr(optimizer, "local_world_size", None)
    par = layout.parallel if layout is not None else None
    if rank is None or size is None:
        if par is None:
            raise StateMismatchError(
                f"ZeRO-1 optimizer {type(optimizer).__name__} has no local_rank/local_world_size and the DP layout is "
                "unknown; pass dp_rank= and dp_size= to the Neuron checkpointer"
            )
        return par.dp_rank, par.dp_size
    rank, size = int(rank), int(size)
    if par is not None and par.ep_size == 1 and (rank, size) != (par.dp_rank, par.dp_size):
        raise StateMismatchError(
            f"ZeRO-1 optimizer shards over {count(size, 'rank')} as local_rank {rank}, but the parallel layout says dp_rank "
            f"{par.dp_rank} of dp_size {par.dp_size}; pass the optimizer's sharding group as dp_rank=/dp_size="
        )
    return rank, size


def _scalar(v: Any) -> Any:
    return v.detach().cpu() if isinstance(v, torch.Tensor) and is_xla(v) else v


def capture_zero1(optimizer: Any, model: Any, layout: NxdLayout) -> tuple[list[NamedTensor], dict[str, Any]]:
    """Named shard tensors (registered in ``layout.zero1_rows``) and the optimizer tree of a ZeRO-1 optimizer."""
    names = param_names_in_optimizer_order(optimizer, model)
    sd = optimizer.state_dict()
    dp_rank, dp_size = dp_of(optimizer, layout)
    shape_info = {int(k): tuple(int(s) for s in v) for k, v in sd["shape_info"].items()}
    tensors: list[NamedTensor] = []
    scalars: dict[str, dict[str, Any]] = {}

    def add(pid: int, key: str, value: torch.Tensor) -> None:
        name = names[pid]
        shape = shape_info[pid]
        start, valid, chunk = zero1.shard_rows(shape[0], dp_size, dp_rank)
        if tuple(value.shape) != (chunk, *shape[1:]):
            raise StateMismatchError(
                f"ZeRO-1 state {name!r} {key}: shard shape {list(value.shape)} is not row chunk {chunk} of "
                f"shape_info {list(shape)} over DP size {dp_size}"
            )
        if valid == 0:
            return  # all padding: this DP rank holds nothing of it
        oname = optim_name(name, key)
        layout.zero1_rows[oname] = (start, shape)
        tensors.append(
            NamedTensor(oname, value if valid == chunk else value[:valid], "optimizer_state", name, key)
        )

    for pid, per_key in sd["base_state"].items():
        for key, v in per_key.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and key != "step":
                add(int(pid), key, v)
            else:
                scalars.setdefault(names[int(pid)], {})[key] = treecodec.encode(
                    _scalar(v), f"optimizer.base_state[{names[int(pid)]}].{key}"
                )
    for pid, w in (sd.get("sharded_master_weights") or {}).items():
        add(int(pid), MASTER_KEY, w)
    meta = optimizer_meta(optimizer, sd["param_groups"], names, scalars)
    base = type(optimizer.base_optimizer)
    meta["base"] = (
        f"{base.__module__}.{base.__qualname__}"  # the wrapper's class says nothing of the update rule
    )
    return tensors, meta


def restore_zero1(reader: Any, layout: NxdLayout, optimizer: Any, model: Any) -> None:
    """Fill a ZeRO-1 optimizer with this DP rank's rows of the saved (merged) state; any DP size works."""
    m = reader.manifest
    meta = m.optimizer
    if meta is None:
        raise StateMismatchError(f"{reader.path}: checkpoint holds no optimizer state")
    names = param_names_in_optimizer_order(optimizer, model)
    pid_of = {n: i for i, n in enumerate(names)}
    stage = stage_tensors(m, layout.parallel)  # under PP: this stage's share of the saved optimizer
    live = optimizer.state_dict()
    if len(meta["param_groups"]) != len(live["param_groups"]):
        raise StateMismatchError(
            f"{reader.path}: checkpoint optimizer has {len(meta['param_groups'])} param_groups, the live one has "
            f"{len(live['param_groups'])}"
        )
    groups = []
    for gi, (saved, g) in enumerate(zip(meta["param_groups"], live["param_groups"], strict=True)):
        live_names = [names[p] for p in g["params"]]
        saved_names = [n for n in saved["params"] if stage is None or n in stage]
        if set(saved_names) != set(live_names):
            diff = sorted(set(saved_names) ^ set(live_names))
            raise StateMismatchError(
                f"{reader.path}: param_groups[{gi}] holds different parameters than the live optimizer: {diff[:4]}"
            )
        dec = {k: treecodec.decode(v) for k, v in saved.items() if k != "params"}
        dec["params"] = list(g["params"])
        groups.append(dec)
    dp_rank, dp_size = dp_of(optimizer, layout)
    shape_info = {int(k): tuple(int(s) for s in v) for k, v in live["shape_info"].items()}
    by_param: dict[str, dict[str, str]] = {}
    for n, t in m.tensors.items():
        if t.role == "optimizer_state" and t.param is not None and t.key is not None:
            by_param.setdefault(t.param, {})[t.key] = n
    host: list[torch.Tensor] = []
    slots: list[tuple[str, int, str]] = []
    for name, keys in by_param.items():
        if stage is not None and name not in stage and name not in pid_of:
            continue  # another PP stage's parameter
        if name not in pid_of:
            raise StateMismatchError(
                f"{reader.path}: optimizer state for {name!r}, which the live optimizer lacks"
            )
        pid = pid_of[name]
        shape = shape_info[pid]
        start, valid, chunk = zero1.shard_rows(shape[0], dp_size, dp_rank)
        for key, ename in keys.items():
            e = reader.entry(ename)
            gshape, gbox, _ = layout.global_box(
                name, shape, Box((start, *[0] * (len(shape) - 1)), (valid, *shape[1:]))
            )
            if gshape != e.shape:
                raise StateMismatchError(
                    f"tensor {ename!r}: checkpoint has shape {list(e.shape)}, the live layout implies {list(gshape)}"
                )
            buf = torch.zeros((chunk, *shape[1:]), dtype=dtype_from_name(e.dtype))
            if valid:
                reader.read_box_into(ename, gbox, buf[:valid])
            host.append(buf)
            slots.append(("master" if key == MASTER_KEY else "state", pid, key))
    device = getattr(optimizer, "device", None) or torch.device("cpu")
    placed = to_device(host, device)
    base_state: dict[int, dict[str, Any]] = {}
    master: dict[int, torch.Tensor] = {}
    for (kind, pid, key), t in zip(slots, placed, strict=True):
        if kind == "master":
            master[pid] = t
        else:
            base_state.setdefault(pid, {})[key] = t
    for name, per in meta.get("state", {}).items():
        if name in pid_of:
            for key, v in per.items():
                base_state.setdefault(pid_of[name], {})[key] = treecodec.decode(v)
    sd: dict[str, Any] = {
        "state": {},
        "param_groups": groups,
        "base_state": base_state,
        "shape_info": shape_info,
    }
    if master:
        missing = [names[p] for p in range(len(names)) if p not in master]
        if missing:
            raise StateMismatchError(f"{reader.path}: master weights missing for {missing[:4]}")
        sd["sharded_master_weights"] = master
    optimizer.load_state_dict(sd)


__all__ = ["capture_zero1", "is_zero1_optimizer", "restore_zero1", "to_host"]
