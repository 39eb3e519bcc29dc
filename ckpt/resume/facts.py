"""What a checkpoint says about itself, handed to the verifier by whoever can read the checkpoint.

The verifier never opens checkpoints: the core manager (or a test) fills ``CheckpointFacts`` from its
manifest and passes a ``FactsProvider``.  That keeps the verifier free of torch state loading and lets it
check the counters that a log alone cannot show (an optimizer whose ``step`` reset to 0 before any spike).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class CheckpointFacts:
    """Counters stored in the checkpoint of ``step``.

    ``optimizer_steps`` maps an optimizer (or param-group) name to its ``step`` counter; after N updates each
    must be N.  ``scheduler_last_epoch`` must be N for a scheduler stepped once per update.  ``samples`` is
    the number of samples consumed after step N.  ``env`` holds versions recorded at save time.  ``dp`` is the
    number of data-parallel ranks that saved; ``rng_shared`` the RNG streams identical on all of them (carried to
    any DP size) and ``rng_streams`` every stream saved (the others are re-derived on another DP size).
    ``scheduler_last_lr`` is the scheduler's ``_last_lr[0]``: the LR the first update after the restore must
    use (it lets the LR be judged exactly when no step overlaps).  ``missing`` names state files a resume
    needs that the checkpoint lacks (``scheduler.pt`` of an HF Trainer checkpoint), with what that causes.
    ``optimizer_hyper`` is the saved optimizer's settings per param group
    (:func:`ckpt.resume.restore_facts.group_hyperparameters`), which the live optimizer must keep.
    """

    step: int
    optimizer_steps: Mapping[str, int] | None = None
    scheduler_last_epoch: int | None = None
    samples: int | None = None
    tokenizer_id: str | None = None
    env: Mapping[str, object] = field(default_factory=dict)
    dp: int | None = None
    rng_shared: tuple[str, ...] | None = None
    rng_streams: tuple[str, ...] | None = None
    scheduler_last_lr: float | None = None
    missing: tuple[str, ...] = ()
    optimizer_hyper: tuple[Mapping[str, Any], ...] | None = None


FactsProvider = Callable[[int, "str | None"], "CheckpointFacts | None"]
"""Called as ``provider(step, path)`` for each restore; returns the facts of that checkpoint or ``None``."""


def facts_from_mapping(facts: Mapping[int, CheckpointFacts]) -> FactsProvider:
    """A provider that looks facts up by step (handy in tests and for a pre-read manifest index)."""

    def provider(step: int, path: str | None) -> CheckpointFacts | None:
        return facts.get(step)

    return provider


class CachedFacts:
    """Base of the providers that read a checkpoint's facts from storage: each (step, path) is read once by
    ``_load`` and kept, since the checks of a boundary (and a replay) ask for the same checkpoint again."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, str | None], CheckpointFacts | None] = {}

    def __call__(self, step: int, path: str | None) -> CheckpointFacts | None:
        key = (step, path)
        if key not in self._cache:
            self._cache[key] = self._load(step, path)
        return self._cache[key]

    def _load(self, step: int, path: str | None) -> CheckpointFacts | None:
        raise NotImplementedError


def folder_digest(
    candidates: Iterable[str | os.PathLike[str]],
    cache: dict[Path, Any],
    notes: list[str],
    read: Callable[..., Any] | None = None,
    **run_options: Any,
) -> Any:
    """The model digest (:func:`ckpt.converters.digest.source_digest`) of the first existing folder among
    ``candidates`` (the logged path, the same name under the root, the step's folder; ``read`` in its place where
    given), cached in ``cache``; None (and a note) when it cannot be read.  Shared by the folder-per-checkpoint providers (Trainer, NxD tags)."""
    from ckpt.converters.digest import source_digest
    from ckpt.errors import CkptError

    for d in dict.fromkeys(Path(c) for c in candidates):
        if d in cache:
            return cache[d]
        if not d.is_dir():
            continue
        try:
            found = cache[d] = (read or source_digest)(str(d), **run_options)
        except (CkptError, OSError, ValueError) as exc:
            notes.append(f"{d}: weights unreadable ({exc})")
            return None
        return found
    return None
