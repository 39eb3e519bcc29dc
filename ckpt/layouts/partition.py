"""How NxD partitions a tensor over TP ranks, by its NxD name: the one place NxD tensor names meet the rule sets.

NxD writes no partition metadata to disk, so a tensor's split is known from its name: the HF tensors stored in it
(:func:`~ckpt.layouts.names.nxd_to_hf_names`) are matched against a rule set (:mod:`~ckpt.layouts.rules`).  Fused
NxD tensors take the rule of their first part, with the stride NxD's parallel layers record: ``gate_up_proj`` is
dim 0 stride 2, the MHA ``qkv_proj.weight`` (a ``ColumnParallelLinear`` with stride 3) dim 0 stride 3, and
``GQAQKVColumnParallelLinear``'s ``weight_q|k|v`` and ``weight_qkv`` dim 0 stride 1.

In a Neuron-layout manifest a partitioned tensor carries ``partition = {"dim", "stride", "tp", "source"}``
(docs/format.md): TP rank ``r`` holds box ``r`` of ``tp`` equal boxes along ``dim``.  The stride is NxD's
bookkeeping, recorded for reference; the box rule alone places the bytes.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from ckpt.layouts.families import family_for_rule_set, rules_with
from ckpt.layouts.names import EXPERT_STACKED, nxd_to_hf_names
from ckpt.layouts.rules import DEFAULT_RULE_SET, Kind, rule_for

Partition = dict[str, Any]
_MHA_FUSED_QKV = re.compile(r"\.self_attn\.qkv_proj\.(weight|bias)$")


@lru_cache(maxsize=8192)
def nxd_partition(
    name: str, rule_set: str = DEFAULT_RULE_SET, replicated: tuple[str, ...] = ()
) -> tuple[int, int] | None:
    """``(partition dim, stride)`` of NxD tensor ``name`` under ``rule_set``; None when it is replicated (by a rule
    of the set or a ``replicated`` glob).  A name neither knows is a ``LayoutError``.

    NxD's stacked expert tensors are ``ExpertFusedColumnParallelLinear`` (``gate_up_proj`` ``[E/ep, H, 2I/tp]``: dim 2,
    stride 2) and ``ExpertFusedRowParallelLinear`` (``down_proj`` ``[E/ep, I/tp, H]``: dim 1).
    """
    family = family_for_rule_set(rule_set)
    stacked = EXPERT_STACKED.match(name) if family.experts is not None else None
    if stacked:
        return (2, 2) if stacked["proj"] == "gate_up" else (1, 1)
    rule = rule_for(nxd_to_hf_names(name, family)[0], rules_with(rule_set, tuple(replicated)), rule_set)
    if rule.kind is Kind.REPLICATED or rule.partition_dim is None:
        return None
    if _MHA_FUSED_QKV.search(name):
        return (rule.partition_dim, 3)
    return (rule.partition_dim, rule.stride)


def partition_entry(
    name: str, tp: int, rule_set: str = DEFAULT_RULE_SET, replicated: tuple[str, ...] = ()
) -> Partition | None:
    """The manifest ``partition`` of NxD tensor ``name`` split over ``tp`` ranks by ``rule_set`` (None: replicated)."""
    found = nxd_partition(name, rule_set, tuple(replicated))
    if found is None:
        return None
    return {"dim": found[0], "stride": found[1], "tp": tp, "source": rule_set}


__all__ = ["Partition", "nxd_partition", "partition_entry"]
