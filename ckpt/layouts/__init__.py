"""The layout engine: maps every tensor between the full (Hugging Face) layout and NxD's TP/PP/ZeRO-1 layouts.

Pure torch, no framework imports.  Plans (``plan.py``) say which slices of which sources make each target
tensor; ``execute.py`` runs them.  Rules and verified NxD facts: ``docs/layouts.md``.
"""

from ckpt.layouts.execute import (
    bit_equal,
    execute,
    full_reader,
    full_state_to_nxd,
    full_to_rank_shards,
    nxd_to_full_state,
    rank_shards_to_full,
    shards_reader,
)
from ckpt.layouts.names import fusion_group, hf_to_nxd_name, nxd_to_hf_names
from ckpt.layouts.plan import (
    LayoutPlan,
    Piece,
    Placement,
    Rank,
    TensorMeta,
    TensorPlan,
    placements,
    plan_full_to_nxd,
    plan_nxd_to_full,
)
from ckpt.layouts.spec import LayoutSpec, ModelDims

__all__ = [
    "LayoutPlan",
    "LayoutSpec",
    "ModelDims",
    "Piece",
    "Placement",
    "Rank",
    "TensorMeta",
    "TensorPlan",
    "bit_equal",
    "execute",
    "full_reader",
    "full_state_to_nxd",
    "full_to_rank_shards",
    "fusion_group",
    "hf_to_nxd_name",
    "nxd_to_full_state",
    "nxd_to_hf_names",
    "placements",
    "plan_full_to_nxd",
    "plan_nxd_to_full",
    "rank_shards_to_full",
    "shards_reader",
]
