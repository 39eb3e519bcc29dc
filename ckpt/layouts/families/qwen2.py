"""Qwen2 / Qwen2.5 (``model_type: qwen2``): Llama's layout plus q/k/v biases, which every Qwen2 checkpoint has.

The biases are split exactly like their weights' rows (NxD's ``ColumnParallelLinear`` / ``GQAQKVColumnParallelLinear``
shard ``bias`` with the weight's output rows: ``bias_q|k|v``, ``bias_qkv``), so the ``nxd-llama`` rules cover them.
"""

from ckpt.layouts.families.base import Family
from ckpt.layouts.families.llama import RULES

FAMILY = Family(
    model_type="qwen2",
    rule_set="nxd-llama",
    rules=RULES,
    summary="Qwen2 / Qwen2.5 (q/k/v biases)",
    qkv_bias=True,
)
