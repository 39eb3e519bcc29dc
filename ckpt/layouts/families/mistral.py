"""Mistral (``model_type: mistral``): Llama's tensors and layout; only the attention window differs at run time, and
``head_dim`` may be set independently of ``hidden_size`` (Mistral-Nemo), which ``ModelDims`` reads from the config."""

from ckpt.layouts.families.base import Family
from ckpt.layouts.families.llama import RULES

FAMILY = Family(
    model_type="mistral",
    rule_set="nxd-llama",
    rules=RULES,
    summary="Mistral (Llama layout, sliding window)",
)
