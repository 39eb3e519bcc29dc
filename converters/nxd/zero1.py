"""ZeRO-1 optimizer shards of NxD (torch_xla ``ZeroRedundancyOptimizer.state_dict()``): merge over DP and re-shard.

Facts (torch_xla ``distributed/zero_redundancy_optimizer.py``, NxD ``optimizer/zero_redundancy_optimizer.py``):

* one dict per DP rank: ``state`` (the wrapper's own, normally ``{}``), ``param_groups`` (params as pids),
  ``base_state = {pid: {"step", "exp_avg", ...}}`` holding this rank's shard, ``shape_info = {pid: TP-local shape}``
  and, with ``save_master_weights``, ``sharded_master_weights = {pid: shard}``;
* shard rule (:mod:`ckpt.layouts.zero1`): pad dim 0 with zeros to a multiple of the DP size, then
  ``chunk(dp)[dp_rank]``; master weight shards keep their padding too; ``step`` (and any 0-dim value) is
  replicated, not sharded;
* ``pid`` counts the optimizer's parameters group by group (``get_shape_info``); NxD's files store no names
  unless the optimizer was built from named parameters (torch >= 2.5: ``param_names`` in each group).  NxD's
  examples build two groups (``get_param_groups_by_weight_decay``: names without "bias"/"norm" first, then the
  others), so pid order equals model order only with a single group.  :func:`resolve_param_names` names pids from
  ``param_names``, or from NxD's parameter order where ckpt knows it, and refuses otherwise; the files ckpt writes
  always carry ``param_names``, with pids in NxD's order (:mod:`ckpt.layouts.nxd_order`).
* The MoE variant (``NeuronEPZero1Optimizer``) adds ``ep_*_offset`` keys: :mod:`.zero1_ep` splits and joins it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ckpt.errors import CkptError, CorruptionError, StateMismatchError
from ckpt.layouts import zero1

Shape = tuple[int, ...]
NO_DECAY_MARKERS = ("bias", "norm")  # NxD examples' get_param_groups_by_weight_decay
_ZERO1_KEYS = {"state", "param_groups", "base_state", "shape_info", "sharded_master_weights"}


def is_zero1_dict(obj: Any) -> bool:
    """True for a ZeRO-1 optimizer dict (it has ``base_state`` and ``shape_info``)."""
    return isinstance(obj, dict) and "base_state" in obj and "shape_info" in obj


def shard_zero1(tensor: torch.Tensor, dp_size: int, empty: zero1.Empty | None = None) -> list[torch.Tensor]:
    """One ZeRO-1 shard per DP rank (the rule: :func:`ckpt.layouts.zero1.shard_all`; ``empty`` allocates them)."""
    return zero1.shard_all(tensor, dp_size, empty)


def merge_zero1(shards: Sequence[torch.Tensor], shape: Sequence[int], *, where: str = "") -> torch.Tensor:
    """Inverse of :func:`shard_zero1` for the shards read from NxD files (a mismatch is damage, exit 1)."""
    return zero1.unshard(shards, shape, where=where, error=CorruptionError)


def _shape(x: Any) -> Shape:
    return tuple(int(s) for s in x)


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters: ``params`` and ``param_names`` are replaced by names in the merged form
    and written again from them (:func:`_pid_groups`)."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _pid_groups(groups: Sequence[Mapping[str, Any]], pid_of: Mapping[str, int]) -> list[dict[str, Any]]:
    """Named groups as NxD files hold them: ``params`` as pids, ``param_names`` next to them (what a torch >= 2.5
    optimizer built from named parameters saves), so readers need not guess which pid is which parameter."""
    out = []
    for g in groups:
        d = {
            k: v for k, v in g.items() if k != "param_names"
        }  # keys in the source's order (NxD's: params last)
        d["params"] = [pid_of[n] for n in g["params"]]
        d["param_names"] = list(g["params"])
        out.append(d)
    return out


def recorded_param_names(param_groups: Sequence[Mapping[str, Any]], *, where: str) -> list[str] | None:
    """Name of each pid from the groups' ``param_names`` (torch >= 2.5 optimizers built from named parameters, and
    every tag ckpt writes); None when no group records them.  Groups that record them only in part, or names that
    do not pair one to one with the group's pids, are damage."""
    has = [("param_names" in g) for g in param_groups]
    if not any(has):
        return None
    if not all(has):
        raise CorruptionError(f"{where}: param group {has.index(False)} has no param_names but others do")
    by_pid: dict[int, str] = {}
    for gi, g in enumerate(param_groups):
        pids, names = list(g.get("params", [])), list(g["param_names"])
        if len(pids) != len(names):
            raise CorruptionError(
                f"{where}: param group {gi} lists {len(pids)} pids but {len(names)} param_names"
            )
        for pid, name in zip(pids, names, strict=True):
            by_pid[int(pid)] = str(name)
    if sorted(by_pid) != list(range(len(by_pid))) or len(set(by_pid.values())) != len(by_pid):
        raise CorruptionError(f"{where}: param_names do not name pids 0..{len(by_pid) - 1} once each")
    return [by_pid[i] for i in range(len(by_pid))]


def resolve_param_names(
    model_shapes: Sequence[tuple[str, Shape]],
    param_groups: Sequence[Mapping[str, Any]],
    shape_info: Mapping[int, Any],
    *,
    where: str,
    num_params: int | None = None,
    explicit: Sequence[str] | None = None,
    order: Callable[[Sequence[str]], list[str] | None] | None = None,
) -> list[str]:
    """Name of each pid (index = pid), checked against ``shape_info``; refused rather than guessed.

    NxD resumes with ``optimizer.load_state_dict``, which maps pids to parameters by position, so the names are:
    ``explicit`` (the caller's), else the groups' ``param_names`` (both must agree when both exist), else the model
    file's key order: NxD saves ``model.state_dict()``, which lists parameters as the live model does.  That order
    is used only where it is NxD's parameter order for the layout (``order``:
    :func:`ckpt.layouts.nxd_order.nxd_param_order` of the model shard's names, None where ckpt does not know it);
    a model file in another order (ckpt's tags before ``param_names``, whose model keys followed the source) is
    refused.  One group: that order.  Two groups: NxD's examples' weight-decay split
    (``get_param_groups_by_weight_decay``: names without "bias"/"norm", then the others) of it when the group sizes
    fit, and only where NxD's order is known; anything else is refused.
    ``num_params`` is for plain torch.optim dicts, where ``shape_info`` comes from the state tensors and may miss pids.
    """
    n = len(shape_info) if num_params is None else num_params
    if num_params is None and sorted(shape_info) != list(range(n)):
        raise CorruptionError(f"{where}: shape_info pids are not 0..{n - 1}")
    sizes = [len(g.get("params", [])) for g in param_groups]
    model_names = [name for name, _ in model_shapes]
    shapes = dict(model_shapes)
    recorded = recorded_param_names(param_groups, where=where)
    if explicit is not None and recorded is not None and list(explicit) != recorded:
        bad = next(
            (i for i, (a, b) in enumerate(zip(explicit, recorded, strict=False)) if a != b), len(recorded)
        )
        raise StateMismatchError(
            f"{where}: param_names given disagree with the file's param_names at pid {bad}"
        )
    given = list(explicit) if explicit is not None else recorded
    if given is not None:
        unknown = [k for k in given if k not in shapes]
        if unknown:
            raise StateMismatchError(
                f"{where}: param_names has '{unknown[0]}' which is not in the model shard"
            )
        cand = given
    else:
        nxd = order(model_names) if order is not None else None
        if nxd is not None and nxd != model_names:
            bad = next(i for i, (a, b) in enumerate(zip(nxd, model_names, strict=True)) if a != b)
            raise StateMismatchError(
                f"{where}: no param_names, and the model file lists '{model_names[bad]}' where NxD's parameter order "
                f"has '{nxd[bad]}', so the order its pids follow is unknown; pass param_names"
            )
        if len(param_groups) <= 1:
            cand = model_names
        elif nxd is None:
            raise StateMismatchError(
                f"{where}: {len(param_groups)} param groups and no param_names, and NxD's parameter order for this "
                "layout is not known to ckpt, so its pids cannot be named; pass param_names"
            )
        else:
            decay = [k for k in nxd if not any(m in k for m in NO_DECAY_MARKERS)]
            no_decay = [k for k in nxd if any(m in k for m in NO_DECAY_MARKERS)]
            if sizes != [len(decay), len(no_decay)]:
                raise StateMismatchError(
                    f"{where}: param groups of {sizes} parameters and no param_names; NxD's weight-decay split of "
                    f"this shard is [{len(decay)}, {len(no_decay)}]; pass param_names"
                )
            cand = decay + no_decay
    if len(cand) != n:
        raise StateMismatchError(
            f"{where}: optimizer has {n} parameters but {len(cand)} names ("
            + ("param_names" if given is not None else "model shard tensors")
            + ")"
        )
    bad = next(
        (pid for pid in sorted(shape_info) if _shape(shape_info[pid]) != _shape(shapes[cand[pid]])), None
    )
    if bad is not None:
        raise StateMismatchError(
            f"{where}: pid {bad} has shape_info {list(_shape(shape_info[bad]))} but model parameter "
            f"'{cand[bad]}' has shape {list(shapes[cand[bad]])}; pass param_names explicitly"
        )
    return cand


class Deferred:
    """A merged optimizer tensor not read yet: its ``shape`` and ``dtype`` are known from the files' metadata,
    :meth:`load` reads and merges it.

    Why: a (tp, pp) rank's ZeRO-1 state is spread over every DP file; merging it all when the rank is opened holds
    the rank's whole optimizer in anonymous memory (the memory-mapped DP files cost none).  Merging one tensor when
    it is read keeps a converter's memory at a few tensors, whatever the model, TP, PP or DP size.
    """

    __slots__ = ("shape", "dtype", "_load")

    def __init__(self, shape: Shape, dtype: torch.dtype, load: Callable[[], torch.Tensor]) -> None:
        self.shape = shape
        self.dtype = dtype
        self._load = load

    def dim(self) -> int:
        return len(self.shape)

    def load(self) -> torch.Tensor:
        return self._load()

    def __repr__(self) -> str:
        return f"Deferred({list(self.shape)}, {self.dtype})"


def materialize(obj: Any) -> Any:
    """``obj`` with every :class:`Deferred` loaded (dicts and lists rebuilt, everything else as it is)."""
    if isinstance(obj, Deferred):
        return obj.load()
    if isinstance(obj, dict):
        return {k: materialize(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [materialize(v) for v in obj]
    return obj


def _deferred_merge(
    dp_dicts: Sequence[Mapping[str, Any]], table: str, pid: int, key: str | None, shape: Shape, where: str
) -> Deferred:
    """The DP shards of ``dp_dicts[*][table][pid][key]`` (``key`` None: ``[table][pid]``), merged when loaded."""

    def shard(d: Mapping[str, Any]) -> Any:
        v = d[table][pid]
        return v if key is None else v[key]

    def load() -> torch.Tensor:
        return merge_zero1([shard(d) for d in dp_dicts], shape, where=where)

    return Deferred(shape, shard(dp_dicts[0]).dtype, load)


def merge_zero1_optimizer(
    dp_dicts: Sequence[Mapping[str, Any]], param_names: Sequence[str], *, where: str, lazy: bool = False
) -> dict[str, Any]:
    """Merge the DP shards of one (tp, pp) rank into ``{"state", "param_groups", "master_weights", "extra"}``.

    ``state`` is ``{name: {key: full TP-local tensor}}``; ``param_groups`` lists names instead of pids;
    ``master_weights`` is ``{name: fp32 tensor}`` or None (NxD's own ``nxd_convert_zero_checkpoints`` drops these);
    ``extra`` keeps any other top-level keys of DP rank 0 (and the wrapper ``state`` when it is not empty).

    ``lazy``: every merged tensor is a :class:`Deferred` (merged when loaded, from ``dp_dicts`` kept alive: pass
    memory-mapped files); the structure, names and presence checks are the same as the eager result's.
    """
    d0 = dp_dicts[0]
    if "ep_param_id_offset" in d0:
        raise CkptError(f"{where}: ZeRO-1 with expert parallelism (NeuronEPZero1Optimizer) is not supported")
    shape_info = {int(k): _shape(v) for k, v in d0["shape_info"].items()}
    for i, d in enumerate(dp_dicts[1:], start=1):
        if {int(k): _shape(v) for k, v in d["shape_info"].items()} != shape_info:
            raise CorruptionError(f"{where}: DP rank {i} has a different shape_info than DP rank 0")
    if len(param_names) != len(shape_info):
        raise StateMismatchError(f"{where}: {len(param_names)} names for {len(shape_info)} pids")
    for i, d in enumerate(dp_dicts):
        if set(d["base_state"]) != set(d0["base_state"]):
            raise CorruptionError(f"{where}: DP rank {i} holds state for other pids than DP rank 0")

    state: dict[str, dict[str, Any]] = {}
    for pid, per_key in d0["base_state"].items():
        name = param_names[pid]
        merged: dict[str, Any] = {}
        for key, v0 in per_key.items():
            if isinstance(v0, torch.Tensor) and v0.dim() > 0 and key != "step":
                if any(key not in d["base_state"][pid] for d in dp_dicts):
                    raise CorruptionError(f"{where}: pid {pid} ('{name}') {key} missing on some DP rank")
                merged[key] = _deferred_merge(
                    dp_dicts, "base_state", pid, key, shape_info[pid], f"{where}: pid {pid} ('{name}') {key}"
                )
            else:
                merged[key] = v0
        state[name] = merged

    master: dict[str, Any] | None = None
    if "sharded_master_weights" in d0:
        master = {}
        for pid, _ in d0["sharded_master_weights"].items():
            name = param_names[pid]
            master[name] = _deferred_merge(
                dp_dicts, "sharded_master_weights", pid, None, shape_info[pid],
                f"{where}: master weight pid {pid} ('{name}')",
            )  # fmt: skip

    groups = copy.deepcopy([_hyper(g) for g in d0["param_groups"]])
    for g, g0 in zip(groups, d0["param_groups"], strict=True):
        g["params"] = [param_names[p] for p in g0["params"]]
    extra = {k: v for k, v in d0.items() if k not in _ZERO1_KEYS}
    if d0.get("state"):
        extra["state"] = d0["state"]
    out = {"state": state, "param_groups": groups, "master_weights": master, "extra": extra}
    if lazy:
        return out
    out["state"] = materialize(state)
    out["master_weights"] = materialize(master)
    return out


def shard_zero1_optimizer(
    merged: Mapping[str, Any],
    param_shapes: Mapping[str, Shape],
    dp_size: int,
    *,
    where: str = "",
    empty: zero1.Empty | None = None,
) -> list[dict[str, Any]]:
    """Inverse of :func:`merge_zero1_optimizer`: the ZeRO-1 dict of every DP rank (index = DP rank).

    pids are assigned group by group in ``param_groups`` order (what torch_xla does); ``param_shapes`` gives each
    parameter's TP-local shape for ``shape_info`` (the model shard's shapes).  ``empty`` allocates the shards
    (file-backed memory: :class:`~.scratch.Scratch`); the values are the same.
    """
    order = [name for g in merged["param_groups"] for name in g["params"]]
    pid_of = {name: pid for pid, name in enumerate(order)}
    missing = [n for n in order if n not in param_shapes]
    if missing:
        raise StateMismatchError(
            f"{where}: no shape for optimizer parameter '{missing[0]}' (not in the model shard)"
        )
    for name in merged["state"]:
        if name not in pid_of:
            raise StateMismatchError(f"{where}: optimizer state for '{name}' which is in no param group")
    out: list[dict[str, Any]] = []
    for _ in range(dp_size):
        groups = _pid_groups(merged["param_groups"], pid_of)
        wrapper_state = merged.get("extra", {}).get("state", {})
        d: dict[str, Any] = {k: v for k, v in merged.get("extra", {}).items() if k != "state"}
        d.update(
            {
                "state": wrapper_state,
                "param_groups": copy.deepcopy(groups),
                "base_state": {},
                "shape_info": {pid: list(param_shapes[n]) for pid, n in enumerate(order)},
            }
        )
        out.append(d)
    for name in sorted(merged["state"], key=pid_of.__getitem__):
        pid = pid_of[name]
        per_rank: list[dict[str, Any]] = [{} for _ in range(dp_size)]
        for key, v in merged["state"][name].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and key != "step":
                if _shape(v.shape) != _shape(param_shapes[name]):
                    raise StateMismatchError(
                        f"{where}: state '{name}' {key} has shape {list(v.shape)}, parameter has {list(param_shapes[name])}"
                    )
                for r, s in enumerate(shard_zero1(v, dp_size, empty)):
                    per_rank[r][key] = s
            else:
                for r in range(dp_size):
                    per_rank[r][key] = v
        for r in range(dp_size):
            out[r]["base_state"][pid] = per_rank[r]
    if merged.get("master_weights") is not None:
        for r in range(dp_size):
            out[r]["sharded_master_weights"] = {}
        for name, w in sorted(merged["master_weights"].items(), key=lambda kv: pid_of[kv[0]]):
            for r, s in enumerate(shard_zero1(w, dp_size, empty)):
                out[r]["sharded_master_weights"][pid_of[name]] = s
    return out


def merge_plain_optimizer(
    opt: Mapping[str, Any], param_names: Sequence[str], *, where: str
) -> dict[str, Any]:
    """A plain ``torch.optim`` state dict (non-ZeRO NxD run) in the same named form as :func:`merge_zero1_optimizer`."""
    state = {param_names[pid]: dict(v) for pid, v in opt.get("state", {}).items()}
    groups = copy.deepcopy([_hyper(g) for g in opt["param_groups"]])
    for g, g0 in zip(groups, opt["param_groups"], strict=True):
        g["params"] = [param_names[p] for p in g0["params"]]
    extra = {k: v for k, v in opt.items() if k not in ("state", "param_groups")}
    return {"state": state, "param_groups": groups, "master_weights": None, "extra": extra}


def plain_optimizer_shapes(opt: Mapping[str, Any]) -> tuple[dict[int, Shape], int]:
    """``(pid -> shape known from its state tensors, number of pids)`` of a plain torch.optim state dict."""
    n = sum(len(g["params"]) for g in opt["param_groups"])
    shapes: dict[int, Shape] = {}
    for pid, per_key in opt.get("state", {}).items():
        for key, v in per_key.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and key != "step":
                shapes[int(pid)] = _shape(v.shape)
                break
    return shapes, n


def unshard_plain_optimizer(merged: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`merge_plain_optimizer`: pids back in ``param_groups`` order."""
    order = [name for g in merged["param_groups"] for name in g["params"]]
    pid_of = {name: pid for pid, name in enumerate(order)}
    groups = copy.deepcopy(_pid_groups(merged["param_groups"], pid_of))
    state = {pid_of[n]: dict(v) for n, v in sorted(merged["state"].items(), key=lambda kv: pid_of[kv[0]])}
    out: dict[str, Any] = {"state": state, "param_groups": groups}
    out.update(merged.get("extra", {}))
    return out
