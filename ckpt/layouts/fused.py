"""Per-rank sizes of NxD's fused tensors, and cutting them back into parts.

``gate_up_proj`` is ``cat[gate_r, up_r]`` (two equal parts).  ``weight_qkv`` is ``cat[q_r, k_r, v_r]``
whose parts are *not* equal under GQA: ``heads/tp`` query heads but ``kv_heads*m/tp`` KV slots.  NxD's
``--convert_to_full_state --fuse_qkv`` splits it into three equal parts, which is wrong for GQA; the sizes
below come from the spec instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ckpt.errors import LayoutError
from ckpt.layouts.rules import Kind, rule_for
from ckpt.layouts.spec import LayoutSpec


def local_part_sizes(hf_names: Sequence[str], spec: LayoutSpec) -> tuple[int, ...]:
    """Dim-0 size of each HF part inside one rank's fused NxD tensor, in concatenation order."""
    m = spec.model
    sizes = []
    for name in hf_names:
        kind = rule_for(name, spec.rules, spec.rule_set).kind
        if kind is Kind.ATTN_Q:
            sizes.append(m.q_rows // spec.tp)
        elif kind is Kind.ATTN_KV:
            sizes.append(spec.kv_slots * m.head_dim // spec.tp)
        elif kind is Kind.GATE_UP:
            sizes.append(m.intermediate // spec.tp)
        else:
            raise LayoutError(f"{name} is not part of a fused NxD tensor")
    return tuple(sizes)


def part_offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    """Start offset of each part (exclusive prefix sum)."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return tuple(out)


def unfuse(tensor: torch.Tensor, sizes: Sequence[int], dim: int = 0) -> tuple[torch.Tensor, ...]:
    """Cut one rank's fused tensor into its parts (views)."""
    if sum(sizes) != tensor.shape[dim]:
        raise LayoutError(
            f"fused tensor has {tensor.shape[dim]} rows on dim {dim}, the layout expects {sum(sizes)}"
        )
    return tuple(torch.split(tensor, list(sizes), dim=dim))


def fuse(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Concatenate one rank's parts into the fused tensor (a new tensor)."""
    return torch.cat(list(parts), dim=dim)
