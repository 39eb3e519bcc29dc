"""LR continuity: the resumed session's learning rates equal the pre-crash (or replayed) schedule exactly.

Learning rates are a pure function of the step, so on any hardware they must match bit for bit.  When they
do not, the pattern names the bug: post-resume LRs equal the schedule's first steps (scheduler not restored:
warmup restarted), equal the neighbour step's (off by one: scheduler rebuilt with ``last_epoch=N``, or
built after loading the optimizer), or neither (a different schedule).
"""

from __future__ import annotations

import numpy as np

from ckpt.resume.checks.base import Cause, CheckResult, Status
from ckpt.resume.checks.context import CheckContext


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
        # No reference for the post steps: only a restarted warmup is still recognisable, by comparing the
        # first post-resume LRs with the first LRs of the run.
        head = post[:k]
        s0 = head[0][0]
        lr_n = pre.get(b.restored_step)
        if s0 > 2 and lr_n is not None and _matches(head, ref, 1 - s0) and head[0][1] != lr_n:
            nums.update(first_step=s0, lr_after=head[0][1], lr_at_restored_step=lr_n)
            return CheckResult(
                "lr",
                Status.FAIL,
                f"LR at step {s0} is {head[0][1]!r}, the run's step-1 LR; it was {lr_n!r} at step "
                f"{b.restored_step}",
                Cause.WARMUP_RESTARTED,
                nums,
            )
        return CheckResult(
            "lr",
            Status.SKIP,
            "no pre-crash or replayed LR for the resumed steps (pass a schedule to replay)",
            None,
            nums,
        )
    if not mism:
        src = "pre-crash log" if all(s in pre for s, _ in compared) else "pre-crash log + replayed schedule"
        nums.update(first_step=compared[0][0], last_step=compared[-1][0])
        return CheckResult(
            "lr", Status.PASS, f"{len(compared)} steps equal to the {src} bit for bit", None, nums
        )
    cause, text = classify(mism[:k], ref)
    s, v = mism[0]
    nums.update(first_mismatch=s, expected=ref[s], got=v)
    return CheckResult(
        "lr",
        Status.FAIL,
        f"step {s}: LR {v!r}, expected {ref[s]!r} ({len(mism)}/{len(compared)} steps differ); {text}",
        cause,
        nums,
    )
