"""Words for counts in reports: ``1 session``, ``2 sessions``, ``1 boundary`` (the one helper is
:func:`ckpt.words.count`; ``plural`` is its name here)."""

from __future__ import annotations

from ckpt.words import count as plural

__all__ = ["plural"]
