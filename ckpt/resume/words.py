"""Words for counts in reports: ``1 session``, ``2 sessions``, ``1 boundary``."""

from __future__ import annotations


def plural(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun in the right number (``many`` defaults to ``one + "s"``)."""
    return f"{n} {one if n == 1 else (many or one + 's')}"
