"""The optimizer state of a LoRA adapter across layouts: torch.optim's state keyed by HF adapter names <-> NxD's
per-rank ``optim/dp_rank_00_tp_rank_TT_pp_rank_PP.pt`` (a plain ``torch.optim`` state dict whose pids are the rank's
LoRA parameters in NxD's module order).

Moments shaped like their parameter are laid out exactly as the parameter (:mod:`ckpt.layouts.lora`); scalar state
(``step``) is per parameter.  HF parameters that NxD fuses into one (q/k/v ``lora_A`` of ``qkv_proj``, gate/up
``lora_A``) must agree on every state value and sit in one param group, else the state has no NxD form and is refused.
With a DP size above one the rank files are ZeRO-1 shards (torch_xla's ``ZeroRedundancyOptimizer`` form, as
NxD's ZeRO-1 optimizer saves one file per DP rank): :func:`to_zero1` / :func:`from_zero1` carry the same per-rank
state through :mod:`.nxd.zero1`, with ``param_names`` recorded in the files ckpt writes.  Files without
``param_names`` are named in NxD's module order, which is their pid order with one param group; several groups
without names are refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from ckpt.errors import LayoutError
from ckpt.layouts.execute import bit_equal
from ckpt.layouts.lora import NXD_LORA, adapter_to_nxd, hf_lora_names, nxd_lora_name, nxd_to_adapter
from ckpt.layouts.plan import Rank
from ckpt.layouts.spec import LayoutSpec

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_PROJ = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "qkv_proj": 0, "o_proj": 3, "gate_up_proj": 0, "down_proj": 1}
_LEAF = {"weight": 0, "weight_q": 0, "weight_k": 1, "weight_v": 2, "weight_qkv": 0}


def module_order(nxd_name: str) -> tuple[int, ...]:
    """Sort key giving NxD ``LoraModel``'s parameter order: layers ascending, attention before MLP, projections in
    their modules' order, ``lora_A`` before ``lora_B``, ``weight_q|k|v`` in that order."""
    m = NXD_LORA.match(nxd_name)
    layer = _LAYER.search(nxd_name)
    if m is None or layer is None:
        raise LayoutError(f"{nxd_name}: not an NxD LoRA parameter of model.layers.N")
    mod = m["mod"].rsplit(".", 1)[-1]
    block = 0 if ".self_attn." in nxd_name else 1
    return (int(layer[1]), block, _PROJ[mod], 0 if m["ab"] == "A" else 1, _LEAF[m["leaf"]])


def _is_moment(v: Any, shape: tuple[int, ...]) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == shape


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bit_equal(a, b)
    return type(a) is type(b) and a == b


def to_nxd(
    optimizer: Mapping[str, Any],
    adapter: Mapping[str, torch.Tensor],
    spec: LayoutSpec,
    shards: Mapping[Rank, Any],
) -> dict[Rank, dict[str, Any]]:
    """Per-rank torch.optim state dicts for the NxD LoRA tag whose rank tensors are ``shards``."""
    state: Mapping[str, Mapping[str, Any]] = optimizer["state"]
    group_of = {n: gi for gi, g in enumerate(optimizer["param_groups"]) for n in g["params"]}
    missing = sorted(set(adapter) - set(group_of))
    if missing:
        raise LayoutError(f"optimizer state: {missing[0]} is in no param group")
    keys = {k for per in state.values() for k in per}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted(keys):
        per_key = {
            n: state[n][key]
            for n in adapter
            if n in state and _is_moment(state[n].get(key), tuple(adapter[n].shape))
        }
        if per_key:
            if len(per_key) != len(adapter):
                absent = sorted(set(adapter) - set(per_key))[0]
                raise LayoutError(f"optimizer state {key!r}: {absent} has none (or not shaped like it)")
            for rank, sd in adapter_to_nxd(per_key, spec).items():
                moments.setdefault(key, {}).update({f"{rank[0]},{rank[1]}/{n}": t for n, t in sd.items()})
    out: dict[Rank, dict[str, Any]] = {}
    for rank in spec.ranks:
        names = sorted(shards.get(rank, {}), key=module_order)
        groups: list[dict[str, Any]] = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in optimizer["param_groups"]
        ]
        rank_state: dict[int, dict[str, Any]] = {}
        for pid, nxd in enumerate(names):
            parts = [h for h in hf_lora_names(nxd) if h in adapter]
            gis = {group_of[h] for h in parts}
            if len(gis) > 1:
                raise LayoutError(
                    f"optimizer: {', '.join(parts)} (one NxD parameter {nxd}) are in different param groups"
                )
            groups[gis.pop()]["params"].append(pid)
            per: dict[str, Any] = {}
            first = state.get(parts[0], {})
            for key, v in first.items():
                if key in moments:
                    per[key] = moments[key][f"{rank[0]},{rank[1]}/{nxd}"]
                    continue
                for other in parts[1:]:
                    if not _same(v, state.get(other, {}).get(key)):
                        raise LayoutError(
                            f"optimizer state {key!r} of {other} differs from {parts[0]}'s; NxD keeps one for {nxd}"
                        )
                per[key] = v.clone() if isinstance(v, torch.Tensor) else v
            if per:
                rank_state[pid] = per
        out[rank] = {"state": rank_state, "param_groups": groups}
    return out


def from_nxd(
    optims: Mapping[Rank, Mapping[str, Any]], shards: Mapping[Rank, Mapping[str, torch.Tensor]], spec: LayoutSpec,
    adapter: Mapping[str, torch.Tensor], where: str,
) -> dict[str, Any]:  # fmt: skip
    """Inverse of :func:`to_nxd`: the state keyed by HF adapter names (every stored copy checked)."""
    named: dict[Rank, dict[str, dict[str, Any]]] = {}
    groups_by_rank: dict[Rank, list[dict[str, Any]]] = {}
    for rank, opt in optims.items():
        if "base_state" in opt or "shape_info" in opt:
            raise LayoutError(
                f"{where}: a ZeRO-1 LoRA optimizer file; only plain torch.optim LoRA state is converted"
            )
        names = sorted(shards.get(rank, {}), key=module_order)
        n = sum(len(g["params"]) for g in opt["param_groups"])
        if n != len(names):
            raise LayoutError(
                f"{where}: tp rank {rank[0]}, pp rank {rank[1]}: the optimizer has {n} parameters, the rank file "
                f"{len(names)} LoRA tensors (an optimizer over more than the adapter?)"
            )
        named[rank] = {names[int(pid)]: dict(v) for pid, v in opt.get("state", {}).items()}
        groups_by_rank[rank] = [{**g, "params": [names[p] for p in g["params"]]} for g in opt["param_groups"]]
    keys = {k for per_rank in named.values() for per in per_rank.values() for k in per}
    state: dict[str, dict[str, Any]] = {h: {} for h in adapter}
    for key in sorted(keys):
        rank_t = {r: {n: per[key] for n, per in pr.items() if key in per} for r, pr in named.items()}
        sample = next(v for pr in rank_t.values() for v in pr.values())
        if isinstance(sample, torch.Tensor) and sample.dim() > 0:
            for h, t in nxd_to_adapter(rank_t, spec).items():
                state[h][key] = t
            continue
        for h in adapter:  # scalar: from the NxD parameter holding h on its first rank; copies must agree
            nxd = nxd_lora_name(h, spec)
            values = [pr[nxd] for pr in rank_t.values() if nxd in pr]
            if values:
                if any(not _same(values[0], v) for v in values[1:]):
                    raise LayoutError(f"{where}: optimizer state {key!r} of {nxd} differs between ranks")
                state[h][key] = values[0].clone() if isinstance(values[0], torch.Tensor) else values[0]
    first = groups_by_rank[min(groups_by_rank)]
    groups = []
    for gi, g in enumerate(first):
        hf = [h for n in dict.fromkeys(n for gs in groups_by_rank.values() for n in gs[gi]["params"])
              for h in hf_lora_names(n) if h in adapter]  # fmt: skip
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": hf})
    return {"state": {h: s for h, s in state.items() if s}, "param_groups": groups}


def to_zero1(
    optim: Mapping[str, Any], shard: Mapping[str, torch.Tensor], dp: int, where: str
) -> list[dict[str, Any]]:
    """One (tp, pp) rank's :func:`to_nxd` dict as the ZeRO-1 dicts of its ``dp`` DP ranks (index = DP rank)."""
    from .nxd.zero1 import merge_plain_optimizer, shard_zero1_optimizer

    names = sorted(shard, key=module_order)
    merged = merge_plain_optimizer(optim, names, where=where)
    shapes = {n: tuple(shard[n].shape) for n in names}
    return shard_zero1_optimizer(merged, shapes, dp, where=where)


def from_zero1(
    dp_dicts: list[Mapping[str, Any]], shard: Mapping[str, torch.Tensor], where: str
) -> dict[str, Any]:
    """Inverse of :func:`to_zero1`: the plain dict :func:`from_nxd` reads (pids in NxD's module order)."""
    from .nxd.zero1 import merge_zero1_optimizer, recorded_param_names

    order = sorted(shard, key=module_order)
    groups = dp_dicts[0]["param_groups"]
    names = recorded_param_names(groups, where=where)
    if names is None:
        if len(groups) > 1:
            raise LayoutError(
                f"{where}: ZeRO-1 LoRA optimizer of {len(groups)} param groups without param_names; cannot name "
                "its pids"
            )
        names = order
    merged = merge_zero1_optimizer(dp_dicts, names, where=where)
    unknown = sorted(set(names) - set(order))
    if unknown:
        raise LayoutError(f"{where}: optimizer state of {unknown[0]}, which the rank's model file lacks")
    pid = {n: i for i, n in enumerate(order)}
    return {
        "state": {pid[n]: dict(v) for n, v in merged["state"].items()},
        "param_groups": [{**g, "params": [pid[n] for n in g["params"]]} for g in merged["param_groups"]],
    }


__all__ = ["from_nxd", "from_zero1", "module_order", "to_nxd", "to_zero1"]
