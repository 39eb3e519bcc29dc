"""What a model family is, as data: the one record the layout engine reads about a ``config.json`` ``model_type``.

NxD writes no partition metadata to disk, so every tensor's split must be known from its name; a family says, for
one kind of Hugging Face decoder, which names exist, how NxD's parallel layers partition each (its rules, replicated
tensors included explicitly), which HF tensors NxD renames or fuses, where PP puts the non-layer tensors, and which
``config.json`` settings it cannot lay out.  The engine (``plan.py``, ``names.py``, ``pipeline.py``, ``spec.py``,
``partition.py``) reads only this record, so adding a family is one module under ``families/`` plus its test.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt.layouts.rules import Kind, Rule, rule_for

# ------------------------------------------------------------------------------------------ shared rule pieces

LORA: tuple[Rule, ...] = (
    Rule(
        r"\.(self_attn\.(q|k|v|qkv)_proj|mlp\.(gate|up|gate_up)_proj)\.lora_A\.weight$", Kind.REPLICATED, None
    ),
    Rule(r"\.(self_attn\.o_proj|mlp\.down_proj)\.lora_B\.weight$", Kind.REPLICATED, None),
)
"""LoRA (``neuronx_distributed.modules.lora``, NxD names): the matrices NxD keeps whole on every TP rank, plain
``nn.Linear`` without NxD's parallel attributes.  The split ones (lora_B of column layers, lora_A of row layers) are
NxD parallel layers whose runtime attributes give their split; adapters convert via ``ckpt/layouts/lora.py``.  First
in every family's rules."""

EMBEDDINGS: tuple[Rule, ...] = (
    Rule(r"(^|\.)embed_tokens\.weight$", Kind.VOCAB, 0),
    Rule(r"(^|\.)lm_head\.weight$", Kind.VOCAB, 0),
)
"""``ParallelEmbedding`` and the vocab-parallel ``lm_head`` (``ColumnParallelLinear``): contiguous dim-0 split."""

ATTENTION: tuple[Rule, ...] = (
    Rule(r"\.self_attn\.q_proj\.(weight|bias)$", Kind.ATTN_Q, 0),
    Rule(r"\.self_attn\.[kv]_proj\.(weight|bias)$", Kind.ATTN_KV, 0),
    Rule(r"\.self_attn\.o_proj\.weight$", Kind.ATTN_O, 1),
)
"""``GQAQKVColumnParallelLinear`` (or three ``ColumnParallelLinear``) and the ``RowParallelLinear`` o_proj."""

DENSE_MLP: tuple[Rule, ...] = (
    Rule(r"\.mlp\.(gate|up)_proj\.(weight|bias)$", Kind.GATE_UP, 0, stride=2),
    Rule(r"\.mlp\.down_proj\.weight$", Kind.ROW, 1),
)
"""``gate_up_proj`` (``ColumnParallelLinear`` stride 2) and the ``RowParallelLinear`` down_proj."""

NORMS: tuple[Rule, ...] = (
    Rule(r"(^|\.)(input_layernorm|post_attention_layernorm|norm)\.weight$", Kind.REPLICATED, None),
    Rule(r"\.self_attn\.o_proj\.bias$", Kind.REPLICATED, None),
    Rule(r"\.mlp\.down_proj\.bias$", Kind.REPLICATED, None),
    Rule(r"(^|\.)rotary_emb\.inv_freq$", Kind.REPLICATED, None),
)
"""Replicated on every TP rank: RMSNorm weights, ``RowParallelLinear`` biases (added after the all-reduce),
rotary buffers."""

QK_NORM: tuple[Rule, ...] = (Rule(r"\.self_attn\.[qk]_norm\.weight$", Kind.REPLICATED, None),)
"""Qwen3's per-head RMSNorm over ``head_dim``: one weight shared by every head, so every TP rank holds it whole."""

FIRST_STAGE = r"(^|\.)(embed_tokens|wte)\."
LAST_STAGE = r"(^|\.)lm_head\.|^model\.norm\.|(^|\.)norm_f\."


@dataclass(frozen=True)
class Rename:
    """A tensor NxD stores under another name, one to one (e.g. Mixtral's router).  ``hf``/``nxd`` are regexes
    with the same named groups; ``to_nxd``/``to_hf`` are ``str.format`` templates over those groups."""

    hf: str
    nxd: str
    to_nxd: str
    to_hf: str

    def forward(self, name: str) -> str | None:
        m = re.match(self.hf, name)
        return self.to_nxd.format(**m.groupdict()) if m else None

    def backward(self, name: str) -> str | None:
        m = re.match(self.nxd, name)
        return self.to_hf.format(**m.groupdict()) if m else None


@dataclass(frozen=True)
class Experts:
    """How a family names its MoE experts, in HF and in NxD's ``expert_mlps`` module.

    HF (the Hub's on-disk form, what ``save_pretrained`` writes): one ``[I, H]`` gate and up and one ``[H, I]`` down
    tensor per expert, named ``{pre}{experts}.{j}.{gate|up|down}.weight``.  NxD (``modules/moe/experts.py``
    ``Experts``): per layer, ``{pre}mlp.expert_mlps.mlp_op.gate_up_proj.weight`` ``[E/ep, H, 2I/tp]`` (an
    ``ExpertFusedColumnParallelLinear``, partition dim 2, stride 2, so ``cat[gate_r^T, up_r^T]`` per expert) and
    ``down_proj.weight`` ``[E/ep, I/tp, H]`` (``ExpertFusedRowParallelLinear``, partition dim 1); expert parallel
    rank ``k`` holds experts ``[k*E/ep, (k+1)*E/ep)``.
    """

    block: str  # HF module of the MoE block under the layer: "block_sparse_moe." or "mlp."
    gate: str  # HF part names: "w1" / "gate_proj"
    up: str
    down: str
    intermediate_key: str = "intermediate_size"  # config key of the expert MLP width
    count_keys: tuple[str, ...] = (
        "num_local_experts",
    )  # config keys of the number of experts, first present wins

    @property
    def count_key(self) -> str:
        return self.count_keys[0]

    def count(self, config: Mapping[str, Any]) -> int:
        """The number of experts ``config`` sets (``KeyError`` naming the first key when none is present)."""
        for key in self.count_keys:
            if config.get(key) is not None:
                return int(config[key])
        raise KeyError(self.count_keys[0])

    def hf_parts(self) -> dict[str, str]:
        return {self.gate: "gate", self.up: "up", self.down: "down"}

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The MoE block's rules: the router replicated (a plain ``nn.Linear`` on every rank), every expert's gate
        and up fused column-parallel (stride 2), its down row-parallel."""
        block, gate, up, down = (re.escape(p) for p in (self.block, self.gate, self.up, self.down))
        return (
            Rule(rf"\.{block}gate\.weight$", Kind.REPLICATED, None),
            Rule(rf"\.{block}experts\.\d+\.({gate}|{up})\.weight$", Kind.GATE_UP, 0, stride=2),
            Rule(rf"\.{block}experts\.\d+\.{down}\.weight$", Kind.ROW, 1),
        )

    @property
    def router_rename(self) -> Rename:
        """HF's router ``{block}gate`` is NxD's ``mlp.router.linear_router`` (``RouterTopK``)."""
        return Rename(
            hf=rf"^(?P<pre>model\.layers\.\d+\.){re.escape(self.block)}gate\.weight$",
            nxd=r"^(?P<pre>model\.layers\.\d+\.)mlp\.router\.linear_router\.weight$",
            to_nxd="{pre}mlp.router.linear_router.weight",
            to_hf="{pre}" + self.block + "gate.weight",
        )


@dataclass(frozen=True)
class Family:
    """One model family (``config.json`` ``model_type``) as NxD lays it out.

    ``rules`` are matched in order against HF names (first match wins) and cover every tensor the family has,
    replicated ones included.  ``rule_set`` is the name recorded in manifests (``extra.nxd.rule_set``, each
    partition's ``source``); families with the same rules share it (``nxd-llama``).  ``qkv_bias``: the HF model
    always has q/k/v biases (Qwen2); ``qk_norm``: per-head q_norm/k_norm (Qwen3); ``experts``: an MoE family.
    ``check_config`` refuses ``config.json`` settings the family module cannot lay out (one-line reason).
    """

    model_type: str
    rule_set: str
    rules: tuple[Rule, ...]
    summary: str
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: Experts | None = None
    renames: tuple[Rename, ...] = ()
    first_stage: str = FIRST_STAGE
    last_stage: str = LAST_STAGE
    check_config: Callable[[Mapping[str, Any]], str | None] | None = field(default=None, compare=False)

    def rule_for(self, name: str) -> Rule:
        """First rule matching HF tensor ``name`` (see :func:`ckpt.layouts.rules.rule_for`)."""
        return rule_for(name, self.rules)


__all__ = [
    "LORA",
    "ATTENTION",
    "DENSE_MLP",
    "EMBEDDINGS",
    "NORMS",
    "QK_NORM",
    "Experts",
    "Family",
    "Rename",
]
