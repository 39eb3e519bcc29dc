"""NxD's stacked MoE expert tensors <-> the per-expert views the planner works on, and expert parallelism (EP).

NxD's ``Experts`` module (``modules/moe/experts.py``) holds, per layer and (tp, ep) rank, ``gate_up_proj.weight``
``[E/ep, H, 2I/tp]`` (``ExpertFusedColumnParallelLinear``: partition dim 2, stride 2, so slot ``e`` is
``cat[gate_j^T cols of rank tp, up_j^T cols of rank tp]``) and ``down_proj.weight`` ``[E/ep, I/tp, H]``
(``ExpertFusedRowParallelLinear``: partition dim 1).  EP rank ``k`` holds experts ``[k*E/ep, (k+1)*E/ep)``: NxD's
``enter_expert_parallel_region`` splits the expert dim into ``ep`` contiguous chunks, chunk ``k`` to EP rank ``k``.
Every other tensor (attention, router, norms) is the same on every EP rank (EP is carved out of data parallelism).

The planner sees expert ``j`` as ``<stacked name>#j`` (``names.py``): the transpose of slot ``j mod E/ep``, laid out
exactly like a dense ``gate_up_proj`` / ``down_proj``.  This module is the only place that transposes and stacks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ckpt.errors import LayoutError
from ckpt.layouts.execute import bit_equal, full_state_to_nxd, nxd_to_full_state
from ckpt.layouts.names import EXPERT_STACKED, expert_view
from ckpt.layouts.plan import Rank
from ckpt.layouts.spec import LayoutSpec

EpRank = tuple[int, int, int]
"""``(tp_rank, pp_rank, ep_rank)``, the order of NxD's file names' ranks (``converters/nxd/naming.py``)."""


def ep_of_expert(spec: LayoutSpec, expert: int) -> tuple[int, int]:
    """``(ep_rank, local slot)`` holding global expert ``expert``."""
    per = spec.model.experts // spec.ep
    return expert // per, expert % per


def stack_experts(
    shards: Mapping[Rank, Mapping[str, torch.Tensor]], spec: LayoutSpec
) -> dict[EpRank, dict[str, torch.Tensor]]:
    """Planner rank tensors ``{(tp, pp): {name: tensor}}`` (expert views included) -> NxD's rank tensors
    ``{(tp, pp, ep): {name: tensor}}`` with each rank's experts stacked (new, contiguous tensors)."""
    out: dict[EpRank, dict[str, torch.Tensor]] = {}
    for (tp, pp), sd in shards.items():
        for k in range(spec.ep):
            rank: dict[str, torch.Tensor] = {}
            slots: dict[str, dict[int, torch.Tensor]] = {}
            for name, t in sd.items():
                view = expert_view(name)
                if view is None:
                    rank[name] = t
                    continue
                stacked, j = view
                ep, slot = ep_of_expert(spec, j)
                if ep == k:
                    if stacked not in rank:
                        rank[stacked] = torch.empty(0)  # keeps the first expert's position in the order
                    slots.setdefault(stacked, {})[slot] = t
            for stacked, by_slot in slots.items():
                per = spec.model.experts // spec.ep
                if sorted(by_slot) != list(range(per)):
                    raise LayoutError(
                        f"{stacked} on tp {tp} pp {pp} ep {k}: experts missing (slots {sorted(by_slot)})"
                    )
                rank[stacked] = torch.stack([by_slot[s].transpose(0, 1) for s in range(per)]).contiguous()
            out[(tp, pp, k)] = rank
    return out


def unstack_experts(
    shards: Mapping[EpRank, Mapping[str, torch.Tensor]], spec: LayoutSpec, *, verify_replicas: bool = False
) -> dict[Rank, dict[str, torch.Tensor]]:
    """NxD's rank tensors ``{(tp, pp, ep): ...}`` -> planner rank tensors ``{(tp, pp): ...}`` (expert views are views
    of the stacked tensors).  Non-expert tensors are read from EP rank 0; with ``verify_replicas`` every other EP
    rank's copy must be bit-identical."""
    per = spec.model.experts // spec.ep if spec.model.experts else 0
    out: dict[Rank, dict[str, torch.Tensor]] = {}
    for (tp, pp, k), sd in sorted(shards.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        if not 0 <= k < spec.ep:
            raise LayoutError(f"found ep rank {k} outside --ep {spec.ep}")
        rank = out.setdefault((tp, pp), {})
        for name, t in sd.items():
            if EXPERT_STACKED.match(name) and spec.family.experts is not None:
                if t.dim() != 3 or t.shape[0] != per:
                    raise LayoutError(
                        f"{name} on tp {tp} pp {pp} ep {k} has shape {list(t.shape)}, expected {per} experts "
                        f"stacked on dim 0 (check --ep {spec.ep})"
                    )
                for slot in range(per):
                    rank[f"{name}#{k * per + slot}"] = t[slot].transpose(0, 1)
            elif k == 0:
                rank[name] = t
            elif verify_replicas and not bit_equal(rank[name], t):
                raise LayoutError(f"{name} on tp {tp} pp {pp} ep {k} differs from its copy on ep 0")
    return out


def full_state_to_nxd_ep(
    state: Mapping[str, torch.Tensor], spec: LayoutSpec
) -> dict[EpRank, dict[str, torch.Tensor]]:
    """Whole HF state dict -> NxD rank tensors per ``(tp, pp, ep)`` (in memory; tests and small models)."""
    return stack_experts(full_state_to_nxd(state, spec), spec)


def nxd_ep_to_full_state(
    shards: Mapping[EpRank, Mapping[str, torch.Tensor]], spec: LayoutSpec, *, verify_replicas: bool = False
) -> dict[str, torch.Tensor]:
    """NxD rank tensors per ``(tp, pp, ep)`` -> the whole HF state dict (every rank checked against ``spec``)."""
    views = unstack_experts(shards, spec, verify_replicas=verify_replicas)
    return nxd_to_full_state(views, spec, verify_replicas=verify_replicas)


__all__ = [
    "EpRank",
    "ep_of_expert",
    "full_state_to_nxd_ep",
    "nxd_ep_to_full_state",
    "stack_experts",
    "unstack_experts",
]
