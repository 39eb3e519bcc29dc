"""The checks run at every resume boundary; each returns a :class:`CheckResult` with a named cause."""

from __future__ import annotations

from ckpt.resume.checks.base import Basis, Cause, CheckResult, Confidence, Status, worst
from ckpt.resume.checks.context import CheckContext, VerifyOptions
from ckpt.resume.checks.digests import check_data, check_rng
from ckpt.resume.checks.history import check_env, check_lost_work
from ckpt.resume.checks.loss import check_loss
from ckpt.resume.checks.lr import check_lr
from ckpt.resume.checks.optimizer import check_optimizer
from ckpt.resume.checks.position import check_position
from ckpt.resume.checks.steps import check_counters, check_step
from ckpt.resume.checks.weights import check_weights

ALL_CHECKS = (
    check_step,
    check_counters,
    check_lr,
    check_data,
    check_position,
    check_rng,
    check_lost_work,
    check_env,
    check_weights,
    check_optimizer,
    check_loss,
)
"""In report order; the loss check runs last so it can defer to a root cause found by the exact checks."""

__all__ = [
    "ALL_CHECKS",
    "Basis",
    "Cause",
    "CheckContext",
    "CheckResult",
    "Confidence",
    "Status",
    "VerifyOptions",
    "check_counters",
    "check_data",
    "check_env",
    "check_loss",
    "check_lost_work",
    "check_lr",
    "check_optimizer",
    "check_position",
    "check_rng",
    "check_step",
    "check_weights",
    "worst",
]
