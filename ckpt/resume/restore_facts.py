"""What a resume's restore record says about the live optimizer and scheduler, taken right after the load.

Why: in tolerance mode small defects (Adam moments zeroed with the step kept, betas or weight decay changed, a
fresh scheduler whose warm restart or milestone lands at the boundary) move the loss less than its noise, or
move the LR exactly where the schedule itself would.  Facts decide them: the live optimizer's settings and
moments against the checkpoint's, and the LRs the checkpoint's scheduler state gives when replayed.  Written by
``CkptCallback`` into the ledger's restore event (:meth:`ckpt.resume.ledger.LedgerWriter.restore`), judged by
:mod:`ckpt.resume.checks.optimizer` and :mod:`ckpt.resume.checks.lr`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

REPLAY_STEPS = 20
"""How many LRs after the restore the scheduler replay gives (N+1 .. N+20)."""

HYPERPARAMETERS = ("betas", "weight_decay", "eps", "momentum", "dampening", "nesterov", "amsgrad")
"""The param-group settings that a checkpoint's optimizer state fixes and a resume must keep (the LR is the
scheduler's)."""


def group_hyperparameters(groups: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per param group, the :data:`HYPERPARAMETERS` it has, as JSON values (tuples as lists)."""
    out = []
    for g in groups:
        out.append({k: list(g[k]) if isinstance(g[k], tuple) else g[k] for k in HYPERPARAMETERS if k in g})
    return out


def optimizer_summary(optimizer: Any) -> dict[str, object] | None:
    """What the restore record says about a live optimizer (:meth:`LedgerWriter.restore`): ``hyper``, the
    settings of each param group, and ``exp_avg_norm``, the L2 norm of Adam's first moments over every
    parameter (None for optimizers without them).  After N > 0 updates the moments are zero only if every
    gradient was zero, so a norm of 0 with the step counter at N says the moments were lost."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return None
    total, seen = 0.0, False
    for st in getattr(optimizer, "state", {}).values():
        m = st.get("exp_avg") if isinstance(st, Mapping) else None
        if m is not None and hasattr(m, "detach"):
            total += float(m.detach().float().pow(2).sum())
            seen = True
    return {"hyper": group_hyperparameters(groups), "exp_avg_norm": total**0.5 if seen else None}


def replay_scheduler(
    template: Any, state: Mapping[str, Any], steps: int = REPLAY_STEPS
) -> list[float] | None:
    """The LRs of the ``steps`` updates after a restore: ``state`` (a checkpoint's ``scheduler.state_dict()``)
    loaded into a copy of ``template`` (the live scheduler: its class and LR functions, which a state dict does
    not hold) bound to a stand-in optimizer, then stepped.  torch and transformers schedulers are deterministic
    from their state, so the result is what the restored schedule must give, whatever the live scheduler was
    later changed to.  None for schedulers driven by metrics (``ReduceLROnPlateau``) or a state without
    ``_last_lr``."""
    import copy

    import torch
    from torch.optim.lr_scheduler import LRScheduler

    last = state.get("_last_lr")
    if not isinstance(template, LRScheduler) or not isinstance(last, (list, tuple)) or not last:
        return None
    bases = state.get("base_lrs") or last
    opt = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": float(v)} for v in last])
    for g, b in zip(opt.param_groups, bases, strict=False):
        g["initial_lr"] = float(b)
    sched = copy.copy(template)
    sched.__dict__ = dict(template.__dict__)
    sched.optimizer = opt
    try:
        sched.load_state_dict(dict(state))
        out = [float(last[0])]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(steps - 1):
                sched.step()
                out.append(float(sched.get_last_lr()[0]))
    except (TypeError, KeyError, ValueError, AttributeError, IndexError):
        return None
    return out
