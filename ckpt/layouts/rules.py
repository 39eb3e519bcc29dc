"""Named rule sets: HF tensor name -> how NxD partitions it.

NxD writes no partition metadata to disk, so the split of every tensor must be known from its name.
Rules are matched in order against the Hugging Face name; the first match wins; anything unmatched is
replicated on every TP rank (norms, RowParallel biases, rotary buffers).  ``partition_dim`` is the dim
NxD's parallel layer shards (``ColumnParallelLinear``/``ParallelEmbedding``: 0, ``RowParallelLinear``: 1),
``stride`` is the ``create_local_weight`` stride of the NxD tensor the HF tensor ends up in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from ckpt.errors import LayoutError


class Kind(str, Enum):
    """What kind of split a tensor gets; the plan builder dispatches on this."""

    VOCAB = "vocab"  # ParallelEmbedding / vocab-parallel lm_head: contiguous dim-0 split
    ATTN_Q = "attn_q"  # query rows, grouped per rank by the GQA head rule
    ATTN_KV = "attn_kv"  # key/value rows, replicated kv_size_multiplier times, then split
    ATTN_O = "attn_o"  # o_proj columns, follow the query heads
    GATE_UP = "gate_up"  # gate/up rows, fused per rank as cat[gate_r, up_r] (stride 2)
    ROW = "row"  # RowParallelLinear weight: contiguous dim-1 split
    REPLICATED = "replicated"  # same full tensor on every TP rank


@dataclass(frozen=True)
class Rule:
    pattern: str
    kind: Kind
    partition_dim: int | None
    stride: int = 1

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None


NXD_LLAMA: tuple[Rule, ...] = (
    # LoRA (neuronx_distributed.modules.lora, NxD names): the matrices NxD keeps whole on every TP rank, plain
    # nn.Linear without NxD's parallel attributes.  The split ones (lora_B of column layers, lora_A of row layers)
    # are NxD parallel layers whose runtime attributes give their split; adapters convert via ckpt/layouts/lora.py.
    Rule(
        r"\.(self_attn\.(q|k|v|qkv)_proj|mlp\.(gate|up|gate_up)_proj)\.lora_A\.weight$", Kind.REPLICATED, None
    ),
    Rule(r"\.(self_attn\.o_proj|mlp\.down_proj)\.lora_B\.weight$", Kind.REPLICATED, None),
    Rule(r"(^|\.)embed_tokens\.weight$", Kind.VOCAB, 0),
    Rule(r"(^|\.)lm_head\.weight$", Kind.VOCAB, 0),
    Rule(r"\.self_attn\.q_proj\.(weight|bias)$", Kind.ATTN_Q, 0),
    Rule(r"\.self_attn\.[kv]_proj\.(weight|bias)$", Kind.ATTN_KV, 0),
    Rule(r"\.self_attn\.o_proj\.weight$", Kind.ATTN_O, 1),
    Rule(r"\.mlp\.(gate|up)_proj\.(weight|bias)$", Kind.GATE_UP, 0, stride=2),
    Rule(r"\.mlp\.down_proj\.weight$", Kind.ROW, 1),
)
"""Llama, Mistral and Qwen2 style decoders as NxD's training models and checkpoint converter lay them out."""

DEFAULT_RULE_SET = "nxd-llama"
RULE_SETS: dict[str, tuple[Rule, ...]] = {DEFAULT_RULE_SET: NXD_LLAMA}

_REPLICATED = Rule(r"", Kind.REPLICATED, None)


def get_rule_set(name: str) -> tuple[Rule, ...]:
    """The rule set called ``name``."""
    try:
        return RULE_SETS[name]
    except KeyError:
        raise LayoutError(
            f"unknown layout rule set {name!r}; known: {', '.join(sorted(RULE_SETS))}"
        ) from None


def rule_for(name: str, rules: tuple[Rule, ...] = NXD_LLAMA) -> Rule:
    """First rule matching HF tensor ``name``; unmatched names are replicated."""
    for rule in rules:
        if rule.matches(name):
            return rule
    return _REPLICATED
