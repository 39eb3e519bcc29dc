"""Qwen3 (``model_type: qwen3``): Llama's layout plus a per-head RMSNorm on queries and keys, and ``head_dim`` set in
the config independently of ``hidden_size / num_attention_heads`` (Qwen3-0.6B: hidden 1024, 16 heads of 128).

``q_norm``/``k_norm`` weights have ``head_dim`` entries applied to every head alike, so every TP rank holds the whole
weight (replicated, like the layer norms).  q_proj has ``heads*head_dim`` rows and o_proj ``heads*head_dim`` columns,
which may differ from ``hidden_size``: every shape comes from ``head_dim``, never from ``hidden/heads``.  NxD 2.29 ships
no Qwen3 model; this is the layout its parallel layers give a Qwen3 built from them (Llama's attention with the two
norms added), and NxD's converter's assumption ``head_dim = hidden/heads`` is wrong for it (docs/layouts.md).
"""

from ckpt.layouts.families.base import QK_NORM, Family
from ckpt.layouts.families.llama import RULES

FAMILY = Family(
    model_type="qwen3",
    rule_set="nxd-qwen3",
    rules=RULES + QK_NORM,
    summary="Qwen3 (q_norm/k_norm, explicit head_dim)",
    qk_norm=True,
)
