"""Llama 2 / 3.x (``model_type: llama``) as NxD's Llama training example lays it out (``examples/training/llama``).

Rules: vocab-parallel embeddings and lm_head, GQA attention (q/k/v by head, o_proj by columns), the fused
``gate_up_proj`` (stride 2) and the row-parallel down_proj; norms, RowParallel biases and rotary buffers replicated.
``attention_bias: true`` adds q/k/v biases (split like their weights) and an o_proj bias (replicated).
"""

from ckpt.layouts.families.base import ATTENTION, DENSE_MLP, EMBEDDINGS, LORA, NORMS, Family

RULES = LORA + EMBEDDINGS + ATTENTION + DENSE_MLP + NORMS

FAMILY = Family(
    model_type="llama",
    rule_set="nxd-llama",
    rules=RULES,
    summary="Llama 2 / 3.x (GQA, fused gate_up)",
)
