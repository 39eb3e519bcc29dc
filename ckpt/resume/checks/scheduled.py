"""Scheduled changes at a boundary: what the run itself meant to change there, so a move is not a defect.

A curriculum that switches its data mix at the first resumed step, a StepLR milestone at N+1 and an epoch
start all move the loss level exactly where a broken restore would.  The logs say which of them happened
(a logged phase tag, the LRs, the position fields); when one did and nothing overlaps, the level test cannot
tell the schedule from a defect and says so (:data:`~ckpt.resume.checks.base.Cause.CANNOT_TELL`, a warning).

:func:`soften` is the other half: when every restored state checks out exactly at a boundary (the weights'
digest, the optimizer's and the scheduler's counters, the data position, the RNG) and only the loss level
moved with no overlap, the loss failure becomes a "cannot tell" warning naming the scheduled causes that can
do that.
"""

from __future__ import annotations

from ckpt.resume.boundaries import Boundary
from ckpt.resume.checks.base import Cause, CheckResult, Confidence, Status

LR_STEP_FACTOR = 3.0
"""An LR change at the boundary larger than this many times the largest per-step change just before it is a
step of the schedule (a milestone), not its smooth motion."""
EXACT_STATE = ("weights", "counters", "data", "rng")
"""The checks that must all pass for :func:`soften`: together they say every piece of state was restored."""


def _last_before(b: Boundary, attr: str) -> tuple[int, object] | None:
    for s in sorted((s for s in b.pre if s <= b.restored_step), reverse=True):
        v = getattr(b.pre[s], attr)
        if v is not None:
            return s, v
    return None


def _first_after(b: Boundary, attr: str) -> tuple[int, object] | None:
    return next(((r.step, getattr(r, attr)) for r in b.post.steps if getattr(r, attr) is not None), None)


def phase_change(b: Boundary) -> str | None:
    """``"phase data/phase=1 -> data/phase=2 at step 61"`` when the logged curriculum phase changes at the
    boundary (the last value up to N against the first resumed one)."""
    before, after = _last_before(b, "phase"), _first_after(b, "phase")
    if before is None or after is None or before[1] == after[1]:
        return None
    return f"logged phase {before[1]} -> {after[1]} at step {after[0]}"


def lr_step(b: Boundary) -> str | None:
    """``"LR 0.1 -> 0.01 at step 61"`` when the LR steps at the boundary: a change far larger than the
    per-step changes of the last logged LRs before it (a milestone, a warm restart, or a defect)."""
    pre = [(s, b.pre[s].lr) for s in sorted(b.pre) if s <= b.restored_step and b.pre[s].lr is not None]
    after = _first_after(b, "lr")
    if len(pre) < 2 or after is None:
        return None
    (s0, a), (s1, v) = pre[-1], after
    recent = pre[-6:]
    local = max(abs(y - x) / max(1, t - s) for (s, x), (t, y) in zip(recent, recent[1:], strict=False))
    gap = abs(float(v) - float(a))  # type: ignore[arg-type]
    if gap <= 1e-6 * abs(float(a)) or gap <= LR_STEP_FACTOR * local * max(1, s1 - s0):  # type: ignore[arg-type]
        return None
    return f"LR {a!r} -> {v!r} at step {s1}"


def scheduled_changes(b: Boundary) -> list[str]:
    """What the logs show the run changed on purpose at the boundary (a phase, an LR step)."""
    return [c for c in (phase_change(b), lr_step(b)) if c]


def cannot_tell(what: str, causes: list[str], nums: dict) -> CheckResult:
    """The loss check's warning when a scheduled change explains the move as well as a defect would."""
    nums["scheduled"] = "; ".join(causes)
    return CheckResult(
        "loss",
        Status.WARN,
        f"{what}; at the same step the run changed on purpose ({'; '.join(causes)}): without overlap the logs "
        "cannot tell the schedule from a broken restore (an overlap, --replay or a bitwise run can)",
        Cause.CANNOT_TELL,
        nums,
    )


def soften(results: list[CheckResult]) -> None:
    """A loss-level failure judged on the trajectory alone, at a boundary where every restored state was
    checked and found exact, becomes a "cannot tell" warning naming the scheduled causes."""
    by_name = {r.name: r for r in results}
    loss = by_name.get("loss")
    # a drop too: "repeated data?" is what it suggests, and the data check passing on the facts refutes that
    if (
        loss is None
        or loss.status is not Status.FAIL
        or loss.cause not in (Cause.LOSS_SHIFT, Cause.LOSS_DROP)
    ):
        return
    if loss.numbers.get("overlap") or "level_z" not in loss.numbers:
        return
    if any(by_name.get(n) is None or by_name[n].status is not Status.PASS for n in EXACT_STATE):
        return
    if any(r.status is Status.FAIL for r in results if r is not loss):
        return
    # the weights check must have compared the model right after the restore (not only earlier checkpoints);
    # the counters check passing means the checkpoint's facts were read and every counter it holds is N
    if not by_name["weights"].numbers.get("compared") or by_name["weights"].numbers.get("not_restored"):
        return
    loss.status = Status.WARN
    loss.cause = Cause.CANNOT_TELL
    loss.confidence = Confidence.LOW
    loss.summary = (
        f"{loss.summary.split(';')[0]}; every restored state checks out exactly (weights digest, optimizer and "
        "scheduler counters, data position, RNG) and nothing overlaps: a scheduled change (a curriculum or "
        "data-mix switch, an LR milestone) moves the level like this; cannot tell"
    )


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b))


def _lr_drops(pts: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(first step at the lower LR, ratio) of every step down of a piecewise-constant LR."""
    return [
        (t, b / a)
        for (_, a), (t, b) in zip(pts, pts[1:], strict=False)
        if b < a and not _same(a, b) and a > 0
    ]


def lr_milestone(pre: list[tuple[int, float]], post: list[tuple[int, float]]) -> tuple[bool, str] | None:
    """An LR that drops at the boundary from a constant value to a constant value, like a StepLR or MultiStepLR
    milestone: (fits, text).  ``fits`` when the run's earlier drops had the same ratio and recur at one period
    that lands on the first resumed step (the schedule's own pattern); otherwise the logs cannot tell a
    milestone from a changed LR.  None when the change is no such drop."""
    head = post[:3]
    if len(pre) < 2 or not head or not _same(pre[-1][1], pre[-2][1]):
        return None
    if not all(_same(head[0][1], v) for _, v in head) or not head[0][1] < pre[-1][1]:
        return None
    (s0, a), (s1, b) = pre[-1], head[0]
    ratio = b / a if a else 0.0
    earlier = _lr_drops(pre)
    same = [d for d, r in earlier if abs(r - ratio) <= 1e-4 * ratio]
    text = f"LR steps down x{ratio:.4g} from {a!r} at step {s0} to {b!r} at step {s1}"
    if same and len(same) == len(earlier):
        gaps = {t - s for s, t in zip(same, same[1:], strict=False)} or {same[0] - pre[0][0]}
        period = gaps.pop() if len(gaps) == 1 else None
        if period and (s1 - same[-1]) % period == 0:
            return (
                True,
                f"{text}: the schedule's own step (x{ratio:.4g} every {period} steps, as at step {same[-1]})",
            )
    said = (
        f"earlier drops at {', '.join(str(d) for d, _ in earlier)}"
        if earlier
        else "the schedule's first drop"
    )
    return False, (
        f"{text} ({said}): a milestone or a changed LR; the logs cannot tell (the checkpoint's scheduler state or "
        "a replayed schedule can)"
    )
