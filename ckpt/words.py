"""Counts in the words users read: ``1 file``, ``2 files``, never ``1 files`` or ``file(s)``.

One place for every message of the CLI and the converters, so that a count and its noun always agree.
"""

from __future__ import annotations

#: nouns whose plural is not the noun + "s"
_IRREGULAR = {"was": "were", "is": "are", "has": "have"}


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``noun`` for one, else ``many`` (default: ``noun + "s"``, or ``"es"`` after s/x/ch/sh)."""
    if n == 1:
        return noun
    if many is not None:
        return many
    if noun in _IRREGULAR:
        return _IRREGULAR[noun]
    return noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


def count(n: int, noun: str, many: str | None = None) -> str:
    """``"1 file"``, ``"3 files"``, ``"2 param groups"``: ``n`` and its noun, agreeing."""
    return f"{n} {plural(n, noun, many)}"


def holds_not_one(path: object, names: list[str], noun: str, command: str) -> str:
    """The refusal of a folder *of* checkpoints where one checkpoint was expected, with what to run instead."""
    last = f"{path}/{names[-1]}".replace("//", "/")
    if len(names) == 1:
        return f"{path} is a folder holding one {noun}, {names[0]}; run: {command} {last}"
    shown = f"{names[0]} .. {names[-1]}" if len(names) > 4 else ", ".join(names)
    return f"{path} holds {count(len(names), noun)} ({shown}), not one; run: {command} {last}"


__all__ = ["count", "holds_not_one", "plural"]
