"""The first ``iter(loader)`` after a restore must not draw from torch's global RNG.

A DataLoader draws its base seed (and torch's ``RandomSampler`` with no ``generator=`` its permutation seed) from
torch's global generator each time an iterator is created.  An uninterrupted run created its iterator at the start
of the epoch and draws nothing at step N+1; a resumed run creates a fresh one right after ckpt restored the global
RNG to its step-N state, so one extra draw would shift every later random number (dropout masks, ...).  The loader's
own position is restored from its saved state (StatefulDataLoader) or by ckpt's adapters, so the seed drawn by that
first iterator is not needed: :func:`keep_rng_on_next_iter` makes that one ``iter()`` leave torch's global RNG as it
found it.  Later ``iter()`` calls (new epochs) draw as in the uninterrupted run.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .tracked import TrackedLoader

_MARK = "_ckpt_keeps_rng_on_iter"


@functools.cache
def _keeping_class(cls: type) -> type:
    """A subclass of ``cls`` whose next ``__iter__`` restores torch's global RNG and then turns back into ``cls``."""

    def __iter__(self: Any) -> Any:
        object.__setattr__(self, "__class__", cls)
        state = torch.get_rng_state()
        replays_sampler = (
            getattr(self, "next_iter_state", None) is not None
            and _shares_generator(self)
            and not self.num_workers
        )
        try:
            return cls.__iter__(self)
        finally:
            torch.set_rng_state(state)
            if replays_sampler:
                _redraw_base_seed(self.generator)

    return type(cls.__name__, (cls,), {"__iter__": __iter__, _MARK: True, "__module__": cls.__module__})


def _shares_generator(loader: Any) -> bool:
    """A StatefulDataLoader whose RandomSampler draws from the loader's own ``generator=``."""
    g = getattr(loader, "generator", None)
    return g is not None and getattr(getattr(loader, "sampler", None), "generator", None) is g


def _redraw_base_seed(generator: torch.Generator) -> None:
    """torchdata's restored iterator draws its base seed from ``generator`` and then sets the sampler's (the same)
    generator back to its epoch-start state and replays the permutation; the uninterrupted run's generator had also
    given that base seed after the permutation, so one draw puts it where that run's was (the next epoch's order).
    Single-process only: the worker iterator's restore keeps the generator in step already
    (tests/test_resume_loader_defaults.py checks both)."""
    torch.empty((), dtype=torch.int64).random_(generator=generator)


def keep_rng_on_next_iter(loader: Any) -> None:
    """Make the next ``iter()`` of ``loader`` (of the DataLoader under a tracked loader) consume no global RNG."""
    from torch.utils.data import DataLoader

    inner = loader.loader if isinstance(loader, TrackedLoader) else loader
    cls = type(inner)
    if not isinstance(inner, DataLoader) or getattr(cls, _MARK, False):
        return  # other loaders' iterators are theirs: only a DataLoader's seed draw is known to be redundant
    object.__setattr__(inner, "__class__", _keeping_class(cls))
