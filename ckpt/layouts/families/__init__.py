"""The model families ckpt lays out, selected by ``config.json``'s ``model_type``: one small module each.

Adding a family: write ``families/<model_type>.py`` defining ``FAMILY`` (a :class:`~.base.Family`), add it to
``_MODULES`` below, and test it (``tests/test_layouts_families.py``).  Nothing else in the engine names a family.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from ckpt.errors import LayoutError
from ckpt.layouts.families import llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from ckpt.layouts.families.base import Experts, Family, Rename
from ckpt.layouts.rules import DEFAULT_RULE_SET, Rule, declared_rules

_MODULES = (llama, mistral, qwen2, qwen3, mixtral, qwen3_moe)

FAMILIES: dict[str, Family] = {m.FAMILY.model_type: m.FAMILY for m in _MODULES}
"""``model_type`` -> family."""

RULE_SETS: dict[str, tuple[Rule, ...]] = {}
"""Rule set name (recorded in manifests) -> rules; families sharing a name share the very same rules."""
for _f in FAMILIES.values():
    if RULE_SETS.setdefault(_f.rule_set, _f.rules) != _f.rules:
        raise AssertionError(f"families naming rule set {_f.rule_set!r} disagree on its rules")

DEFAULT_MODEL_TYPE = "llama"


def get_rule_set(name: str) -> tuple[Rule, ...]:
    """The rule set called ``name``."""
    try:
        return RULE_SETS[name]
    except KeyError:
        raise LayoutError(
            f"unknown layout rule set {name!r}; known: {', '.join(sorted(RULE_SETS))}"
        ) from None


@lru_cache(maxsize=64)
def rules_with(rule_set: str | None = DEFAULT_RULE_SET, replicated: tuple[str, ...] = ()) -> tuple[Rule, ...]:
    """The rules of ``rule_set`` (None: the default) followed by the user's replicated globs.

    The family's rules come first, so a glob never turns a tensor the rules shard into a replicated one.
    """
    return get_rule_set(rule_set or DEFAULT_RULE_SET) + declared_rules(replicated)


def supported() -> tuple[str, ...]:
    """The ``model_type`` values ckpt can lay out, sorted."""
    return tuple(sorted(FAMILIES))


def get_family(model_type: str) -> Family:
    """The family of ``config.json`` ``model_type``; an unknown one is refused with the supported list."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise LayoutError(
            f"config model_type {model_type!r} is not supported (supported: {', '.join(supported())})"
        ) from None


def rule_set_for_config(config: Mapping[str, Any] | None) -> str:
    """The rule set of ``config``'s model family; ``nxd-llama`` when there is no config or its ``model_type`` has
    no family (what every Neuron save and NxD import used before families existed)."""
    family = FAMILIES.get(str((config or {}).get("model_type")))
    return family.rule_set if family is not None else DEFAULT_RULE_SET


def family_for_rule_set(rule_set: str) -> Family:
    """The (first) family recorded under ``rule_set``: what a saver that knows only the rule set name lays out
    (families sharing a rule set share their names too)."""
    for family in FAMILIES.values():
        if family.rule_set == rule_set:
            return family
    get_rule_set(rule_set)  # refuses the unknown name, listing the known ones
    raise AssertionError(rule_set)  # every rule set is some family's


__all__ = [
    "FAMILIES",
    "RULE_SETS",
    "Experts",
    "Family",
    "Rename",
    "family_for_rule_set",
    "get_family",
    "get_rule_set",
    "rule_set_for_config",
    "rules_with",
    "supported",
]
