"""Resume verification: the run ledger, log readers (:mod:`.sources`), continuity checks (:mod:`.checks`), the
verifier (:mod:`.verify`), run comparison (:mod:`.compare`) and the recovery-cost report (:mod:`.cost`).

Spec of the run directory: docs/run-dir.md; how verdicts are reached: docs/verify-resume.md.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def __getattr__(name: str) -> ModuleType:
    # ``ckpt.resume.ledger.tokenizer_id(tok)`` as the docs write it, without importing every module up front
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
