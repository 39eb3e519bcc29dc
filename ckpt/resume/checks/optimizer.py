"""The optimizer's settings and moments, and the gradient accumulation, across a resume: from facts only.

Why: zeroed Adam moments with the step counter kept, changed betas or weight decay and a changed gradient
accumulation move a small model's loss less than its noise, so in tolerance mode the loss cannot show them.
Facts can: the restore record's summary of the live optimizer (:mod:`ckpt.resume.restore_facts`, written by
``CkptCallback``) against the checkpoint's saved param groups (:class:`~ckpt.resume.facts.CheckpointFacts`
``optimizer_hyper``), moments that are all zero after N > 0 updates, and the accumulation each session logged.
Where a run carries none of these facts (logs only) and no bitwise overlap decides, the check says "cannot tell"
and names what it could not decide: never a confident pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpt.resume.checks.base import Basis, Cause, CheckResult, Confidence, Status
from ckpt.resume.checks.context import CheckContext

ACCUMULATION = "gradient_accumulation_steps"
UNDECIDED = (
    "the optimizer's moments and settings (betas, weight decay)",
    "the gradient accumulation",
    "an LR applied inside optimizer.step other than the logged one",
)
"""What logs alone cannot decide in tolerance mode (docs/verify-resume.md, "Cannot tell")."""


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _hyper_changes(saved: tuple[Mapping[str, Any], ...], live: list[Mapping[str, Any]]) -> list[str]:
    if len(saved) != len(live):
        return [f"{len(saved)} param groups in the checkpoint, {len(live)} after the restore"]
    out = []
    for i, (a, b) in enumerate(zip(saved, live, strict=True)):
        for key in a:
            if key in b and not _same(a[key], b[key]):
                out.append(f"param group {i} {key} {a[key]} in the checkpoint, {b[key]} after the restore")
    return out


def _accumulation(ctx: CheckContext) -> tuple[Any, Any]:
    b = ctx.boundary
    before = b.dead.env.get(ACCUMULATION) if b.dead is not None else None
    return before, b.post.env.get(ACCUMULATION)


def check_optimizer(ctx: CheckContext) -> CheckResult:
    b = ctx.boundary
    n = b.restored_step
    record = b.restore if b.restore is not None and not b.restore.inferred else None
    live = record.optimizer if record is not None else None
    nums: dict[str, int | float | str | None] = {}
    failures: list[tuple[Cause, str]] = []
    decided: list[str] = []
    saved = ctx.facts.optimizer_hyper if ctx.facts is not None else None
    hyper = live.get("hyper") if isinstance(live, dict) else None
    if saved is not None and isinstance(hyper, list):
        decided.append("settings")
        failures += [(Cause.OPTIMIZER_SETTINGS, t) for t in _hyper_changes(saved, hyper)]
    norm = live.get("exp_avg_norm") if isinstance(live, dict) else None
    if isinstance(norm, (int, float)) and record is not None:
        decided.append("moments")
        nums["exp_avg_norm_after_restore"] = float(norm)
        if norm == 0 and n > 0 and record.optimizer_step == n:
            failures.append(
                (
                    Cause.OPTIMIZER_LOST,
                    f"Adam's first moments are all zero after the restore while its step counter says {n} "
                    "updates (moments reset, step kept)",
                )
            )
    before, after = _accumulation(ctx)
    if before is not None and after is not None:
        decided.append("accumulation")
        nums.update(accumulation_before=str(before), accumulation_after=str(after))
        if before != after:
            failures.append(
                (
                    Cause.ACCUMULATION_CHANGED,
                    f"gradient accumulation {before} before the resume, {after} after it (the effective batch "
                    "and the updates per sample changed)",
                )
            )
    if failures:
        return CheckResult(
            "optimizer", Status.FAIL, "; ".join(t for _, t in failures), failures[0][0], nums
        ).judged(Basis.CHECKPOINT, Confidence.EXACT)
    if decided:
        return CheckResult(
            "optimizer",
            Status.PASS,
            f"optimizer {', '.join(decided)} as the checkpoint left them",
            None,
            nums,
        ).judged(Basis.CHECKPOINT, Confidence.EXACT)
    bitwise = ctx.deterministic and bool(b.overlap)
    if record is None and not bitwise:
        # A warning without a cause: the row says what could not be decided, the run's causes stay the ones
        # found (a cause here would stand on every logs-only verdict and name nothing that happened).
        return CheckResult(
            "optimizer",
            Status.WARN,
            f"cannot tell from these logs {', '.join(UNDECIDED[:-1])} or {UNDECIDED[-1]}: small changes there "
            "move the loss less than its noise (CkptCallback's restore record and the checkpoint decide the "
            "first two; a bitwise overlap decides all)",
            None,
            nums,
        ).judged(Basis.TRAJECTORY, Confidence.LOW)
    return CheckResult("optimizer", Status.SKIP, "no optimizer facts logged with the restore", None, nums)
