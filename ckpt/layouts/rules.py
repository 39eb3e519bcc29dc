"""Named rule sets: HF tensor name -> how NxD partitions it.

NxD writes no partition metadata to disk, so the split of every tensor must be known from its name.
The rule sets themselves are data, one per model family (``ckpt/layouts/families/``); this module says what a rule
is and how one is chosen.  Rules are matched in order against the Hugging Face name; the first match wins; anything unmatched is
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


DEFAULT_RULE_SET = "nxd-llama"
"""The rule set of Llama, Mistral and Qwen2 (``families/llama.py``); what a saver uses when told nothing else."""

_REPLICATED = Rule(r"", Kind.REPLICATED, None)


def get_rule_set(name: str) -> tuple[Rule, ...]:
    """The rule set called ``name`` (as recorded in a manifest: ``nxd-llama``, ``nxd-qwen3``, ...)."""
    from ckpt.layouts.families import RULE_SETS  # the families import this module

    try:
        return RULE_SETS[name]
    except KeyError:
        raise LayoutError(
            f"unknown layout rule set {name!r}; known: {', '.join(sorted(RULE_SETS))}"
        ) from None


def rule_for(name: str, rules: tuple[Rule, ...]) -> Rule:
    """First rule matching HF tensor ``name``; unmatched names are replicated."""
    for rule in rules:
        if rule.matches(name):
            return rule
    return _REPLICATED
