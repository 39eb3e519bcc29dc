"""Named rule sets: HF tensor name -> how NxD partitions it.

NxD writes no partition metadata to disk, so the split of every tensor must be known from its name.
The rule sets themselves are data, one per model family (``ckpt/layouts/families/``, which also looks a rule set up
by the name manifests record); this module says what a rule is and how unknown names are refused.  Rules are matched in order against the Hugging Face name; the first match wins.  A rule set names every tensor
of its model family, the replicated ones too (norms, RowParallel biases, rotary buffers): a name no rule matches
is *not* assumed replicated, because a TP-sharded tensor the rules do not know would then lose every other rank's
rows.  Such a name is refused (:func:`check_known`) unless the user declares it replicated (``--replicated GLOB``,
``replicated=[...]``), and a declared replica is still compared across ranks wherever copies are read.

``partition_dim`` is the dim NxD's parallel layer shards (``ColumnParallelLinear``/``ParallelEmbedding``: 0,
``RowParallelLinear``: 1), ``stride`` is the ``create_local_weight`` stride of the NxD tensor the HF tensor ends up in.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from ckpt.errors import LayoutError
from ckpt.words import count, plural


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

#: how many unmatched names an error lists before "(+N more)"
_LISTED = 5


def declared_rules(globs: Sequence[str]) -> tuple[Rule, ...]:
    """Replicated rules for the user's ``--replicated`` globs (``fnmatch`` syntax over the whole tensor name)."""
    out = []
    for g in globs:
        if not isinstance(g, str) or not g:
            raise LayoutError(f"--replicated {g!r}: expected a non-empty glob such as '*.expert_bias'")
        out.append(Rule("^" + fnmatch.translate(g), Kind.REPLICATED, None))
    return tuple(out)


def find_rule(name: str, rules: tuple[Rule, ...]) -> Rule | None:
    """First rule matching HF tensor ``name``; None when no rule does."""
    for rule in rules:
        if rule.matches(name):
            return rule
    return None


def unmatched_message(names: Sequence[str], rule_set: str | None = None) -> str:
    """The refusal for tensor names no rule matches: the first few, the count, and the fix."""
    shown = ", ".join(names[:_LISTED]) + (f" (+{len(names) - _LISTED} more)" if len(names) > _LISTED else "")
    n = len(names)
    return (
        f"{count(n, 'tensor')} {plural(n, 'matches', 'match')} no rule of layout rule set "
        f"{rule_set or DEFAULT_RULE_SET}: {shown}; {plural(n, 'its', 'their')} split over TP ranks is unknown. "
        f"If {plural(n, 'it is', 'they are')} replicated on every rank, declare {plural(n, 'it', 'them')} with "
        "--replicated GLOB (library: replicated=[...]); a sharded tensor this rule set does not know cannot be "
        "converted"
    )


def rule_for(name: str, rules: tuple[Rule, ...], rule_set: str | None = None) -> Rule:
    """First rule matching HF tensor ``name``; an unmatched name is a ``LayoutError`` (never assumed replicated)."""
    rule = find_rule(name, rules)
    if rule is None:
        raise LayoutError(unmatched_message([name], rule_set))
    return rule


def check_known(names: Iterable[str], rules: tuple[Rule, ...], rule_set: str | None = None) -> None:
    """Refuse, listing them, the ``names`` no rule of ``rules`` matches."""
    missing = [n for n in dict.fromkeys(names) if find_rule(n, rules) is None]
    if missing:
        raise LayoutError(unmatched_message(missing, rule_set))
