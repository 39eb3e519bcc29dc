"""LR continuity: the resumed session's learning rates equal the pre-crash (or replayed) schedule exactly.

Learning rates are a pure function of the step, so on any hardware they must match bit for bit.  When they
do not, the pattern names the bug: post-resume LRs equal the schedule's first steps (scheduler not restored:
warmup restarted), equal the neighbour step's (off by one: scheduler rebuilt with ``last_epoch=N``, or
built after loading the optimizer), or neither (a different schedule).

When no step overlaps and no schedule is replayed, the LR is judged against the restored checkpoint's own
scheduler state (its ``_last_lr`` is exactly the LR step N+1 must use), else against the run's trajectory
(:mod:`ckpt.resume.checks.lr_trajectory`).  Every result says which (``basis``) and how sure it is.
"""

from __future__ import annotations

import numpy as np

from ckpt.resume.checks.base import Basis, Cause, CheckResult, Confidence, Status
from ckpt.resume.checks.context import CheckContext
from ckpt.resume.checks.lr_trajectory import scan
from ckpt.resume.checks.scheduled import lr_milestone
from ckpt.words import count


def _reference(ctx: CheckContext) -> tuple[dict[int, float], dict[int, float]]:
    """(reference LR by step, pre-crash LR by step).  The log wins where it has the step; a replayed
    schedule fills the rest, rounded to the log's precision so float32 TensorBoard scalars compare exactly."""
    pre = {s: r.lr for s, r in ctx.boundary.pre.items() if r.lr is not None}
    ref = dict(pre)
    if ctx.lr_reference:
        f32 = ctx.run.precision == "float32"
        for s, v in ctx.lr_reference.items():
            if s not in ref:
                ref[s] = float(np.float32(v)) if f32 else v
    return ref, pre


def _matches(pairs: list[tuple[int, float]], ref: dict[int, float], offset: int) -> bool:
    """Every pair whose shifted step has a reference equals it, and at least two (or all) do."""
    known = [(ref[s + offset], v) for s, v in pairs if s + offset in ref]
    return len(known) >= min(2, len(pairs)) and all(r == v for r, v in known)


def classify(pairs: list[tuple[int, float]], ref: dict[int, float]) -> tuple[Cause, str]:
    """Name the pattern of mismatched (step, lr) pairs against the reference schedule."""
    s0 = pairs[0][0]
    for j in (1, 2):
        if s0 - j > 0 and _matches(pairs, ref, j - s0):
            return Cause.WARMUP_RESTARTED, f"LR after resume equals the schedule from step {j} on"
    for off, word in ((1, "ahead"), (-1, "behind")):
        if _matches(pairs, ref, off):
            return Cause.LR_OFF_BY_ONE, f"LR is one step {word} of the schedule"
    return Cause.LR_DIFFERENT, "LR matches neither the schedule nor a shifted copy of it"


def _cast(ctx: CheckContext, value: float) -> float:
    """A value computed outside the log (checkpoint facts) at the log's precision."""
    return float(np.float32(value)) if ctx.run.precision == "float32" else value


def _scheduled(
    ctx: CheckContext, pre_pts: list[tuple[int, float]], post: list[tuple[int, float]]
) -> CheckResult | None:
    """Judge against the LRs the restore record replayed from the checkpoint's scheduler state (a warm
    restart or a milestone at N+1 is then expected, exactly); None when the record has none."""
    b = ctx.boundary
    n = b.restored_step
    r = b.restore
    if r is None or r.inferred or r.step != n or not r.scheduled_lr:
        return None
    ref = {n + 1 + i: _cast(ctx, v) for i, v in enumerate(r.scheduled_lr)}
    pairs = [(s, v) for s, v in post if s in ref]
    if not pairs:
        return None
    mism = [(s, v) for s, v in pairs if ref[s] != v]
    nums: dict[str, int | float | str | None] = {"compared": len(pairs), "mismatched": len(mism)}
    if not mism:
        nums.update(first_step=pairs[0][0], last_step=pairs[-1][0])
        return CheckResult(
            "lr",
            Status.PASS,
            f"{count(len(pairs), 'step')} equal to the checkpoint's scheduler state replayed, bit for bit",
            None,
            nums,
        ).judged(Basis.REPLAY, Confidence.EXACT)
    cause, text = classify(mism[: ctx.options.lr_pattern_steps], {**dict(pre_pts), **ref})
    s, v = mism[0]
    nums.update(first_mismatch=s, expected=ref[s], got=v)
    return CheckResult(
        "lr",
        Status.FAIL,
        f"step {s}: LR {v!r}, the checkpoint's scheduler state replayed gives {ref[s]!r} ({len(mism)}/"
        f"{len(pairs)} steps differ); {text}",
        cause,
        nums,
    ).judged(Basis.REPLAY, Confidence.EXACT)


def _no_overlap(ctx: CheckContext, pre: dict[int, float], post: list[tuple[int, float]]) -> CheckResult:
    """Judge from the checkpoint's scheduler state when it has one, else from the trajectory alone."""
    b = ctx.boundary
    n = b.restored_step
    pre_pts = sorted((s, v) for s, v in pre.items() if s <= n)
    replayed = _scheduled(ctx, pre_pts, post)
    if replayed is not None:
        return replayed
    found = scan(pre_pts, post, n, ctx.run.precision)
    f = ctx.facts
    nums: dict[str, int | float | str | None] = {"compared": 0}
    if f is not None and f.scheduler_last_lr is not None and f.step == n and post[0][0] == n + 1:
        want, got = _cast(ctx, f.scheduler_last_lr), post[0][1]
        nums.update(expected=want, got=got, first_step=n + 1)
        if found is not None:
            nums.update({f"trajectory_{k}": v for k, v in found.numbers.items()})
        if want == got:
            # N+1 is exactly right (the restored optimizer's LR); the steps after it can still show a fresh
            # scheduler taking over (warmup restarted from its second value) or one that stopped stepping.
            later = scan(pre_pts, post, n, ctx.run.precision, start=1)
            if later is not None and later.cause is not None:
                nums.update({f"trajectory_{k}": v for k, v in later.numbers.items()})
                status = Status.WARN if later.confidence is Confidence.LOW else Status.FAIL
                return CheckResult("lr", status, later.text, later.cause, nums).judged(
                    Basis.TRAJECTORY, later.confidence
                )
            if found is not None and found.cause is Cause.LR_FROZEN:
                return CheckResult("lr", Status.FAIL, found.text, found.cause, nums).judged(
                    Basis.TRAJECTORY, found.confidence
                )
            return CheckResult(
                "lr",
                Status.PASS,
                f"LR at step {n + 1} equals the checkpoint scheduler's last LR {want!r}",
                None,
                nums,
            ).judged(Basis.CHECKPOINT, Confidence.EXACT)
        cause, why = Cause.LR_DIFFERENT, "matches no shifted copy of the trajectory"
        if found is not None and found.cause is not None:
            cause, why = found.cause, found.text
        return CheckResult(
            "lr",
            Status.FAIL,
            f"LR at step {n + 1} is {got!r}, the checkpoint's scheduler says {want!r}; {why}",
            cause,
            nums,
        ).judged(Basis.CHECKPOINT, Confidence.EXACT)
    if found is None:
        return CheckResult(
            "lr", Status.SKIP, "too few LRs logged around the boundary to judge its trajectory", None, nums
        )
    nums.update(found.numbers)
    milestone = lr_milestone(pre_pts, post) if found.cause is Cause.LR_DIFFERENT else None
    if milestone is not None:
        fits, text = milestone
        if fits:
            return CheckResult("lr", Status.PASS, text, None, nums).judged(Basis.TRAJECTORY, Confidence.HIGH)
        return CheckResult("lr", Status.WARN, text, Cause.CANNOT_TELL, nums).judged(
            Basis.TRAJECTORY, Confidence.LOW
        )
    if found.cause is None:
        return CheckResult("lr", Status.PASS, found.text, None, nums).judged(
            Basis.TRAJECTORY, found.confidence
        )
    status = Status.FAIL if found.confidence is not Confidence.LOW else Status.WARN
    return CheckResult("lr", status, found.text, found.cause, nums).judged(Basis.TRAJECTORY, found.confidence)


def check_lr(ctx: CheckContext) -> CheckResult:
    b = ctx.boundary
    ref, pre = _reference(ctx)
    post = [(r.step, r.lr) for r in b.post.steps if r.lr is not None]
    if not post:
        return CheckResult("lr", Status.SKIP, "no LR logged after the resume")
    compared = [(s, v) for s, v in post if s in ref]
    mism = [(s, v) for s, v in compared if ref[s] != v]
    k = ctx.options.lr_pattern_steps
    nums: dict[str, int | float | str | None] = {"compared": len(compared), "mismatched": len(mism)}
    if not compared:
        return _no_overlap(ctx, pre, post)
    basis = Basis.OVERLAP if all(s in pre for s, _ in compared) else Basis.REPLAY
    if not mism:
        src = "pre-crash log" if basis is Basis.OVERLAP else "pre-crash log + replayed schedule"
        nums.update(first_step=compared[0][0], last_step=compared[-1][0])
        return CheckResult(
            "lr", Status.PASS, f"{count(len(compared), 'step')} equal to the {src} bit for bit", None, nums
        ).judged(basis, Confidence.EXACT)
    cause, text = classify(mism[:k], ref)
    s, v = mism[0]
    nums.update(first_mismatch=s, expected=ref[s], got=v)
    return CheckResult(
        "lr",
        Status.FAIL,
        f"step {s}: LR {v!r}, expected {ref[s]!r} ({len(mism)}/{len(compared)} steps differ); {text}",
        cause,
        nums,
    ).judged(basis, Confidence.EXACT)
