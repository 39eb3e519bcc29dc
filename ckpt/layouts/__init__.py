"""The layout engine: maps every tensor between the full (Hugging Face) layout and NxD's TP/PP/ZeRO-1 layouts.

Pure torch, no framework imports.  Plans (``plan.py``) say which slices of which sources make each target
tensor; ``execute.py`` runs them.  Rules and verified NxD facts: ``docs/layouts.md``.
"""

from __future__ import annotations

from ckpt import lazy

# Public name -> defining module, imported on first use (PEP 562): the family registry
# (``ckpt.layouts.families``), which ``ckpt convert --help`` lists, must not pay for torch.
_EXPORTS = {
    **dict.fromkeys(
        ("bit_equal", "execute", "full_reader", "full_state_to_nxd", "full_to_rank_shards", "nxd_to_full_state",
         "rank_shards_to_full", "shards_reader"),
        "execute",
    ),
    **dict.fromkeys(("fusion_group", "hf_to_nxd_name", "nxd_to_hf_names"), "names"),
    **dict.fromkeys(
        ("LayoutPlan", "Piece", "Placement", "Rank", "TensorMeta", "TensorPlan", "placements", "plan_full_to_nxd",
         "plan_nxd_to_full"),
        "plan",
    ),
    **dict.fromkeys(("LayoutSpec", "ModelDims"), "spec"),
}  # fmt: skip


__getattr__ = lazy.exports(__name__, _EXPORTS, cache=globals())


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
