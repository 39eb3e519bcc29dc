"""Data position continuity from the position fields a log carries: ``epoch``, ``samples``, ``tokens``.

Where the run stands in its data only grows within one process, by a steady amount per step (one batch of
samples, ``1 / steps_in_epoch`` of an epoch).  So at a resume the first logged value must continue the value at
the restored step N by that per-step amount:

- *back* (the epoch or sample count is smaller than at N): the data restarted (a Trainer resumed with
  ``ignore_data_skip=True`` logs epoch 1.375 at step 44 and 1.031 at step 45, a fresh sampler starts at 0);
  the loss cannot show this, these fields can;
- *ahead or behind* by more than the run's own per-step changes allow (plus one epoch for an integer epoch
  counter, which may roll over in the gap): batches skipped or repeated;
- with overlap, the resumed steps must log the same values as the pre-crash steps.

It also says where epochs start (:func:`epoch_starts`), which the loss check needs: a loss that drops at the
start of every epoch (a model memorising its data) drops at a resume that starts an epoch too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ckpt.resume.checks.base import Basis, Cause, CheckResult, Confidence, Status
from ckpt.resume.checks.context import CheckContext
from ckpt.resume.model import StepRecord

FIELDS = ("epoch", "samples", "tokens")
RATE_POINTS = 20
"""How many logged values before N give the per-step change."""


def _tol(value: float) -> float:
    """Two logged positions closer than this are the same position (float32 TensorBoard scalars)."""
    return 1e-6 * max(1.0, abs(value))


def _points(records: Sequence[StepRecord], attr: str) -> list[tuple[int, float]]:
    out = []
    for r in records:
        v = getattr(r, attr)
        if v is not None and math.isfinite(v):
            out.append((r.step, float(v)))
    return out


def _integral(points: Sequence[tuple[int, float]]) -> bool:
    return all(float(v).is_integer() for _, v in points)


def epoch_index(value: float, integral: bool) -> int:
    """The epoch a step trained in: an integer counter (Lightning) is the index itself; a fractional epoch
    (HF: ``epoch + (i + 1) / steps_in_epoch`` after step i) is in epoch ``ceil(value) - 1``."""
    return int(value) if integral else math.ceil(value - 1e-9) - 1


def epoch_starts(records: Sequence[StepRecord]) -> list[int]:
    """Steps (in ``records`` order) that trained the first logged batch of a new epoch."""
    pts = _points(records, "epoch")
    integral = _integral(pts)
    out = []
    for (_, a), (s, b) in zip(pts, pts[1:], strict=False):
        if epoch_index(b, integral) > epoch_index(a, integral):
            out.append(s)
    return out


def _judge(
    attr: str, pre: list[tuple[int, float]], post: list[tuple[int, float]], n: int
) -> tuple[str, str] | None:
    """(verdict, text): verdict ``back`` / ``jump`` / ``ok``; None when there is nothing to compare."""
    before = [(s, v) for s, v in pre if s <= n]
    if not before or not post:
        return None
    (s0, v0), (s1, v1) = before[-1], post[0]
    if v1 < v0 - _tol(v0):
        return "back", f"{attr} went back from {v0:g} at step {s0} to {v1:g} at step {s1}"
    recent = before[-RATE_POINTS:]
    rates = [(b - a) / (t - s) for (s, a), (t, b) in zip(recent, recent[1:], strict=False) if t > s]
    if not rates:
        return "ok", f"{attr} {v0:g} at step {s0}, {v1:g} at step {s1}"
    span = s1 - s0
    integral = _integral(recent + [(s1, v1)])
    lo = min(rates) * span - _tol(v1)
    hi = max(rates) * span + _tol(v1) + (1.0 if attr == "epoch" and integral else 0.0)
    # one step's worth of slack at the rate: a last batch of an epoch or a gradient-accumulation remainder
    lo -= max(rates)
    hi += max(rates)
    moved = v1 - v0
    if lo <= moved <= hi:
        return "ok", f"{attr} continues: {v0:g} at step {s0}, {v1:g} at step {s1}"
    per = sorted(rates)[len(rates) // 2]
    steps = f" ({moved / per:.1f} steps' worth over {span})" if per > 0 else ""
    return "jump", f"{attr} moved from {v0:g} at step {s0} to {v1:g} at step {s1}{steps}"


def check_position(ctx: CheckContext) -> CheckResult:
    """Each position field continues from N (without overlap) or equals the pre-crash values (with it)."""
    b = ctx.boundary
    n = b.restored_step
    pre_records = [b.pre[s] for s in sorted(b.pre)]
    nums: dict[str, int | float | str | None] = {}
    passed: list[str] = []
    for attr in FIELDS:
        post = _points(b.post.steps, attr)
        pre = _points(pre_records, attr)
        if not post or not pre:
            continue
        at = dict(pre)
        same = [(s, at[s], v) for s, v in post if s in at and s > n]
        if same:
            bad = [(s, a, v) for s, a, v in same if abs(a - v) > _tol(a)]
            nums[f"{attr}_compared"] = len(same)
            if bad:
                s, a, v = bad[0]
                nums.update({f"{attr}_first_mismatch": s, f"{attr}_pre": a, f"{attr}_post": v})
                return CheckResult(
                    "position",
                    Status.FAIL,
                    f"step {s}: {attr} {v:g}, {a:g} before the crash ({len(bad)}/{len(same)} steps differ)",
                    Cause.DATA_POSITION_LOST,
                    nums,
                ).judged(Basis.OVERLAP, Confidence.EXACT)
            passed.append(f"{attr} equal on {len(same)} overlapping steps")
            continue
        found = _judge(attr, pre, post, n)
        if found is None:
            continue
        verdict, text = found
        nums[f"{attr}_after"] = post[0][1]
        if verdict == "back":
            return CheckResult(
                "position",
                Status.FAIL,
                f"{text}: the resumed run is behind where the checkpoint stood (the data restarted)",
                Cause.DATA_POSITION_LOST,
                nums,
            ).judged(Basis.TRAJECTORY, Confidence.HIGH)
        if verdict == "jump":
            return CheckResult(
                "position",
                Status.FAIL,
                f"{text}: more than the run's per-step change allows (batches skipped or repeated)",
                Cause.DATA_POSITION_LOST,
                nums,
            ).judged(Basis.TRAJECTORY, Confidence.HIGH)
        passed.append(text)
    if not passed:
        return CheckResult(
            "position", Status.SKIP, "no position field (epoch, samples, tokens) on both sides"
        )
    basis = Basis.OVERLAP if all("overlapping" in t for t in passed) else Basis.TRAJECTORY
    conf = Confidence.EXACT if basis is Basis.OVERLAP else Confidence.HIGH
    return CheckResult("position", Status.PASS, "; ".join(passed), None, nums).judged(basis, conf)
