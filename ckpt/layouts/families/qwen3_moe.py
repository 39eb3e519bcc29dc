"""Qwen3-MoE (``model_type: qwen3_moe``): Qwen3's attention (q_norm/k_norm, explicit head_dim) with NxD's MoE layer
(``RouterTopK`` + ``ExpertMLPs``, as in NxD's Mixtral example; NxD 2.29 ships no Qwen3-MoE model).

HF (Hub files): ``mlp.gate.weight`` ``[E, H]`` and per expert ``j`` ``mlp.experts.j.{gate,up}_proj.weight``
(``[I, H]``, ``I = moe_intermediate_size``) and ``down_proj.weight`` (``[H, I]``).  NxD: ``mlp.router.linear_router``
(replicated) and ``mlp.expert_mlps.mlp_op.{gate_up,down}_proj.weight`` (``base.Experts``).  Every layer must be sparse:
``mlp_only_layers`` or ``decoder_sparse_step != 1`` (dense layers between MoE ones) are refused.
"""

from collections.abc import Mapping
from typing import Any

from ckpt.layouts.families.base import ATTENTION, EMBEDDINGS, LORA, NORMS, QK_NORM, Experts, Family

EXPERTS = Experts(
    block="mlp.",
    gate="gate_proj",
    up="up_proj",
    down="down_proj",
    intermediate_key="moe_intermediate_size",
    count_keys=("num_experts", "num_local_experts"),  # the Hub's / transformers 5's save_pretrained
)


def _check(config: Mapping[str, Any]) -> str | None:
    if config.get("mlp_only_layers"):
        return f"mlp_only_layers={list(config['mlp_only_layers'])} (dense layers in an MoE model) is not supported"
    if int(config.get("decoder_sparse_step", 1) or 1) != 1:
        return f"decoder_sparse_step={config['decoder_sparse_step']} (dense layers in an MoE model) is not supported"
    return None


FAMILY = Family(
    model_type="qwen3_moe",
    rule_set="nxd-qwen3-moe",
    rules=LORA + EMBEDDINGS + ATTENTION + QK_NORM + EXPERTS.rules + NORMS,
    summary="Qwen3-MoE (q_norm/k_norm, replicated router, expert_mlps with EP)",
    qk_norm=True,
    experts=EXPERTS,
    renames=(EXPERTS.router_rename,),
    check_config=_check,
)
