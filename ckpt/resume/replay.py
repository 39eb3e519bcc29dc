"""Replay an LR schedule from the user's scheduler factory, as the exact reference for LR continuity.

Useful when the pre-crash log does not cover the resumed steps (the crash came right after a save), or to
check the whole run against the schedule it was meant to follow.  The factory is called on a throwaway
one-parameter optimizer, so any ``torch.optim.lr_scheduler`` (``LambdaLR``, ``SequentialLR``, ...) works.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any


def replay_lr(scheduler_factory: Callable[[Any], Any], *, base_lr: float, steps: int) -> dict[int, float]:
    """LR used by each optimizer step ``1..steps`` (read before ``scheduler.step()``, as the ledger logs it).

    ``scheduler_factory(optimizer)`` must build the scheduler exactly as training does, for the full
    schedule length (a save run that builds a shorter schedule has a different LR for a reason that is not
    a bug).  ``base_lr`` is the optimizer's configured learning rate.
    """
    import torch

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=base_lr)
    scheduler = scheduler_factory(optimizer)
    out: dict[int, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()" is harmless here
        for step in range(1, steps + 1):
            out[step] = float(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    return out
