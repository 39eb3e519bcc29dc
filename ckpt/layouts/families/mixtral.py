"""Mixtral (``model_type: mixtral``) as NxD's Mixtral training example lays it out
(``examples/training/mixtral/modeling_mixtral_moe_nxd.py``: ``RouterTopK`` + ``ExpertMLPs``).

HF (Hub files): ``block_sparse_moe.gate.weight`` ``[E, H]`` and per expert ``j`` ``block_sparse_moe.experts.j.w1``
(gate, ``[I, H]``), ``w3`` (up) and ``w2`` (down, ``[H, I]``).  NxD: the router ``mlp.router.linear_router.weight``
(a plain ``nn.Linear``, replicated on every rank) and ``mlp.expert_mlps.mlp_op.{gate_up,down}_proj.weight``
(``base.Experts``).  Attention is Llama's.
"""

from ckpt.layouts.families.base import ATTENTION, EMBEDDINGS, LORA, NORMS, Experts, Family

EXPERTS = Experts(block="block_sparse_moe.", gate="w1", up="w3", down="w2")

FAMILY = Family(
    model_type="mixtral",
    rule_set="nxd-mixtral",
    rules=LORA + EMBEDDINGS + ATTENTION + EXPERTS.rules + NORMS,
    summary="Mixtral (MoE: replicated router, expert_mlps with EP)",
    experts=EXPERTS,
    renames=(EXPERTS.router_rename,),
)
