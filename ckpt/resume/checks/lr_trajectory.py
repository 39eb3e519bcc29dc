"""Judge the LR at a boundary from the run's own trajectory, when no step overlaps and nothing is replayed.

A schedule is a smooth function of the step, so the LRs logged before the restore point N and after it must
join: the step from N to N+1 lies between the local slopes on either side (a warmup-to-decay kink included).
When they do not join, the trajectory itself names the cause:

- the first post-resume LRs equal an earlier stretch of the same run exactly: the schedule went back by k
  steps (k = N: the warmup restarted; k = 1: off by one, behind);
- both sides have the same slope but the gap is several slopes wide: shifted ahead by k steps (k = 1: the
  scheduler rebuilt with ``last_epoch=N`` steps once in its constructor);
- the post-resume LR stays constant where the schedule was falling steadily: the scheduler is not stepping (a
  rising LR that stops is ``constant_with_warmup``, and a fall that flattens is a floor: neither counts);
- otherwise a jump far outside the *local* step-to-step changes on both sides (the last and first
  ``LOCAL_POINTS`` logged LRs): a different schedule, an error.  Judging against the run's largest change
  anywhere would let a warmup's big steps excuse a halved peak LR late in training.

The junction is not only N -> N+1: when the optimizer is restored but the scheduler is not, the first update
uses the restored optimizer's LR (right) and the fresh scheduler's second value from then on, so the first
few post-resume steps are each judged as a junction (:func:`scan`).

Pure functions on (step, lr) lists; :mod:`ckpt.resume.checks.lr` turns the answer into a check result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ckpt.resume.checks.base import Cause, Confidence
from ckpt.words import count

REPEAT_STEPS = 5
"""How many post-resume LRs must equal an earlier stretch (fewer when fewer were logged, at least 2)."""
JUMP_FACTOR = 3.0
"""A gap larger than this many times the local per-step change (both sides of the junction) is a jump."""
LOCAL_POINTS = 5
"""How many logged LRs on each side of a junction define its local per-step change."""
SLOPE_SLACK = 0.25
"""Relative slack on the local slopes (a cosine's slope changes a little from one step to the next)."""


@dataclass(frozen=True, slots=True)
class Finding:
    """The trajectory's answer: ``cause`` None means the two sides join (continuous)."""

    cause: Cause | None
    text: str
    confidence: Confidence
    numbers: dict[str, float | int | str | None] = field(default_factory=dict)


def tolerance(value: float, precision: str) -> float:
    """The absolute difference below which two logged LRs are the same number at the log's precision."""
    rel = 2.0**-22 if precision == "float32" else 1e-12
    return abs(value) * rel + 1e-300


def _same(a: float, b: float, precision: str) -> bool:
    return abs(a - b) <= tolerance(max(abs(a), abs(b)), precision)


def _slope(points: list[tuple[int, float]]) -> float | None:
    """LR change per step between the last two points (the first two for the post side)."""
    if len(points) < 2:
        return None
    (s0, v0), (s1, v1) = points[0], points[1]
    return (v1 - v0) / (s1 - s0) if s1 != s0 else None


def _max_change(points: list[tuple[int, float]]) -> float:
    """The largest per-step LR change between consecutive logged points."""
    return max(
        (abs(b - a) / max(1, t - s) for (s, a), (t, b) in zip(points, points[1:], strict=False)), default=0.0
    )


def _smooth(points: list[tuple[int, float]], precision: str) -> bool:
    """No logged change is a jump against both its neighbours (warmup, cosine, linear and their kinks are
    smooth; StepLR's drops and SGDR's restarts are not)."""
    ch = [(b - a) / max(1, t - s) for (s, a), (t, b) in zip(points, points[1:], strict=False)]
    for i in range(1, len(ch) - 1):
        tol = tolerance(max(abs(v) for _, v in points[i : i + 3]), precision)
        if abs(ch[i]) > JUMP_FACTOR * max(abs(ch[i - 1]), abs(ch[i + 1])) + tol:
            return False
    return True


def _decaying(pre: list[tuple[int, float]], precision: str) -> bool:
    """The LR fell at each of the last 3 logged steps, and not ever more slowly towards a floor: a schedule
    that must keep moving.  A rising LR may legitimately stop (``constant_with_warmup``), so it never counts."""
    pts = pre[-4:]
    if len(pts) < 4:
        return False
    pairs = list(zip(pts, pts[1:], strict=False))
    drops = [a - b for (_, a), (_, b) in pairs]
    if any(
        d <= tolerance(max(abs(a), abs(b)), precision)
        for d, ((_, a), (_, b)) in zip(drops, pairs, strict=True)
    ):
        return False
    return drops[-1] >= 0.5 * drops[0]


def find_repeat(
    pre: list[tuple[int, float]], post: list[tuple[int, float]], precision: str
) -> tuple[int, int] | None:
    """(k, first repeated step): the smallest k >= 1 such that the first post LRs equal the pre LRs k steps
    earlier, over a stretch with at least two distinct values (a constant stretch equals anything)."""
    lr_at = dict(pre)
    head = post[:REPEAT_STEPS]
    s0 = head[0][0]
    for p, _ in sorted(pre, reverse=True):
        k = s0 - p
        if k < 1:
            continue
        known = [(lr_at[s - k], v) for s, v in head if s - k in lr_at]
        if len(known) < max(2, min(3, len(head))) or not all(_same(a, b, precision) for a, b in known):
            continue
        values = [a for a, _ in known]
        if len(values) >= 2 and all(_same(values[0], x, precision) for x in values[1:]):
            continue
        return k, p
    return None


def judge(
    pre: list[tuple[int, float]], post: list[tuple[int, float]], restored_step: int, precision: str
) -> Finding | None:
    """Judge the junction of ``pre`` (steps <= N, ascending) and ``post`` (steps > N, ascending).

    None when there are too few points to say anything (fewer than two before, none after).
    """
    pre = [(s, v) for s, v in pre if s <= restored_step and math.isfinite(v)]
    post = [(s, v) for s, v in post if math.isfinite(v)]
    if len(pre) < 2 or not post:
        return None
    (sn, an), (s1, b0) = pre[-1], post[0]
    gap = b0 - an
    da = _slope(pre[-2:])
    db = _slope(post[:2])
    smooth = _smooth(pre, precision)
    if smooth:
        own = max(_max_change(pre[-LOCAL_POINTS:]), _max_change(post[:LOCAL_POINTS]))
    else:  # a step schedule (StepLR, MultiStepLR): its own drops are the scale a jump is judged on
        own = max(_max_change(pre), _max_change(post))
    nums: dict[str, float | int | str | None] = {
        "lr_before": an,
        "lr_after": b0,
        "step_before": sn,
        "step_after": s1,
        "local_change": own,
    }
    tol = tolerance(max(abs(an), abs(b0)), precision)
    span = s1 - sn
    slopes = [x for x in (da, db) if x is not None]
    lo = min(slopes) * span if slopes else 0.0
    hi = max(slopes) * span if slopes else 0.0
    # The chord of a smooth schedule lies between its slopes on either side; the slack covers half the
    # difference of those slopes (curvature) plus a little of their size, so a one-step shift stays visible
    # even across a gap of several unlogged steps.
    slack = 0.5 * (hi - lo) + SLOPE_SLACK * max((abs(x) for x in slopes), default=0.0) + tol
    if db is None and da is not None:
        # One side only: the curvature is unknown from the two slopes, so allow the pre side's own change of
        # slope (its last two per-step slopes) over the span.
        prev = _slope(pre[-3:-1])
        slack += abs(da - prev) * span if prev is not None else SLOPE_SLACK * abs(da) * span
    joins = lo - slack <= gap <= hi + slack

    # A scheduler that stopped stepping: constant after the resume, moving before it.
    was_moving = _decaying(pre, precision)
    head = [v for _, v in post[:REPEAT_STEPS]]
    frozen = len(head) >= 3 and all(_same(head[0], x, precision) for x in head[1:])
    # An exact repeat of an earlier stretch is decisive even where the junction looks smooth (a restarted
    # warmup can land next to the old value by chance); schedules that really repeat (SGDR) are the exception.
    rep = find_repeat(pre, post, precision)
    if joins and rep is None and not (was_moving and frozen):
        return Finding(
            None, f"LR joins the trajectory: {an!r} at step {sn}, {b0!r} at step {s1}", Confidence.HIGH, nums
        )
    if rep is not None:
        k, p = rep
        nums.update(shift_steps=-k, repeats_from_step=p)
        if p == pre[0][0] or p <= 2:
            return Finding(
                Cause.WARMUP_RESTARTED,
                f"LR after resume repeats the run's LR from step {p} on ({b0!r} at step {s1}; it was {an!r} at "
                f"step {sn})",
                Confidence.HIGH,
                nums,
            )
        peak = max(v for _, v in pre)
        before_p = [v for s, v in pre if s < p]
        if _same(b0, peak, precision) and before_p and before_p[-1] < peak:
            # The stretch repeated starts where the LR first reached its peak: a warm restart (SGDR,
            # cosine_with_restarts) does exactly this on purpose; only the scheduler's state can tell.
            return Finding(
                Cause.CANNOT_TELL,
                f"LR after resume repeats the run's LR from its peak at step {p} on ({b0!r} at step {s1}): a "
                "scheduled warm restart (cosine_with_restarts, SGDR) does this, and so does a scheduler restored "
                "at the wrong step; the checkpoint's scheduler state (CkptCallback's replay) or an overlap decides",
                Confidence.LOW,
                nums,
            )
        if k == 1:
            return Finding(
                Cause.LR_OFF_BY_ONE,
                f"LR is one step behind: step {s1} repeats step {p}'s {b0!r}",
                Confidence.HIGH,
                nums,
            )
        return Finding(
            Cause.LR_SHIFTED,
            f"LR is {count(k, 'step')} behind: step {s1} repeats step {p}'s {b0!r}",
            Confidence.HIGH,
            nums,
        )
    if was_moving and frozen:
        nums["frozen_steps"] = len(head)
        return Finding(
            Cause.LR_FROZEN,
            f"LR stays {head[0]!r} for the first {count(len(head), 'step')} after the resume; it changed every step before",
            Confidence.HIGH,
            nums,
        )
    if da is not None and db is not None and abs(da) > tol and da * db > 0:
        if abs(da - db) <= SLOPE_SLACK * max(abs(da), abs(db)):
            slope = 0.5 * (da + db)
            steps = gap / slope
            k = round(steps) - span
            if k != 0:
                nums.update(shift_steps=k, gap_in_steps=steps)
                # Across a logging interval the chord also carries the schedule's curvature (steepest at a
                # cosine's middle, where both side slopes are flatter than the chord): a shift of less than half
                # the interval cannot be told from it (a clean cosine logged every 10th step reads "2 ahead").
                exact = abs(steps - round(steps)) < 0.2 and (span == 1 or 2 * abs(k) >= span)
                conf = Confidence.HIGH if exact else Confidence.LOW
                word = "ahead" if k > 0 else "behind"
                cause = Cause.LR_OFF_BY_ONE if abs(k) == 1 else Cause.LR_SHIFTED
                return Finding(
                    cause,
                    f"LR is {abs(k)} step{'s' if abs(k) > 1 else ''} {word} of the trajectory: from {an!r} at "
                    f"step {sn} it moved {steps:.2f} steps' worth to {b0!r} at step {s1}",
                    conf,
                    nums,
                )
    ratio = abs(gap) / (own * span) if own > 0 else math.inf
    if smooth and da is not None and db is not None:
        # Outside the chord a smooth schedule allows by more than a whole span's worth of its steeper side.
        outside = max(lo - gap, gap - hi, 0.0) / (max(abs(da), abs(db)) * span + tol)
        nums["beyond_slopes"] = outside
        ratio = max(ratio, JUMP_FACTOR * outside)
    nums["jump_ratio"] = ratio if math.isfinite(ratio) else None
    if ratio > JUMP_FACTOR:
        times = f"{ratio:.1f} times the local per-step change on both sides" if own > 0 else "a constant LR"
        return Finding(
            Cause.LR_DIFFERENT,
            f"LR jumps from {an!r} at step {sn} to {b0!r} at step {s1}: {times}",
            Confidence.HIGH,
            nums,
        )
    return Finding(
        Cause.LR_DIFFERENT,
        f"LR from {an!r} at step {sn} to {b0!r} at step {s1} does not follow the local slope",
        Confidence.LOW,
        nums,
    )


def scan(
    pre: list[tuple[int, float]],
    post: list[tuple[int, float]],
    restored_step: int,
    precision: str,
    *,
    start: int = 0,
    junctions: int = REPEAT_STEPS,
) -> Finding | None:
    """Judge the junctions before each of the first ``junctions`` post steps (from index ``start``): the first
    one that does not join is the answer; else the N -> N+1 verdict.  None when nothing can be judged."""
    pre = [(s, v) for s, v in pre if s <= restored_step and math.isfinite(v)]
    post = [(s, v) for s, v in post if math.isfinite(v)]
    first: Finding | None = None
    for j in range(start, min(len(post), junctions)):
        f = judge(pre + post[:j], post[j:], post[j - 1][0] if j else restored_step, precision)
        if f is None:
            continue
        if f.cause is not None:
            if j == 0:
                return f
            nums = {**f.numbers, "first_bad_step": post[j][0]}
            return Finding(
                f.cause, f"{f.text} ({j} step{'s' if j > 1 else ''} after the resume)", f.confidence, nums
            )
        first = first or f
    return first
