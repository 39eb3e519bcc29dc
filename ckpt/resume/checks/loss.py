"""Loss continuity: bitwise in deterministic mode, else within a noise floor calibrated before the boundary.

The reference for a post-resume step is, first, the same step's loss in the pre-crash session (the free
A/B: a crash at M after a checkpoint at N leaves N+1..M logged twice); failing that, the robust level
trend of the last pre-boundary steps (a Theil-Sen line held at its value at N+1).  The noise is calibrated
locally, on the last ``noise_window`` steps before N: against the pre-crash value it is the robust (median/MAD)
standard deviation of step-to-step differences (the scale of the difference between two noisy evaluations of
one step); against the trend it is the robust spread of the residuals about that line.  A level shift or spike right after the boundary is what lost optimizer
moments (Adam's first update is ``lr * sign(g)``) or a reset AMP scaler look like.
"""

from __future__ import annotations

import math

from ckpt.resume.checks.base import Basis, Cause, CheckResult, Confidence, Status
from ckpt.resume.checks.context import CheckContext
from ckpt.resume.checks.stats import diff_sigma, median, robust_sigma, theil_sen


def _window(ctx: CheckContext) -> list[tuple[int, float]]:
    """The last ``noise_window`` finite (step, loss) pairs up to N: the local calibration span."""
    b = ctx.boundary
    n = b.restored_step
    steps = sorted(s for s in b.pre if s <= n)
    pts = [(s, b.pre[s].loss) for s in steps if b.pre[s].loss is not None and math.isfinite(b.pre[s].loss)]
    return pts[-ctx.options.noise_window :]  # type: ignore[return-value]


def check_loss(ctx: CheckContext) -> CheckResult:
    b = ctx.boundary
    opt = ctx.options
    post = [(r.step, r.loss) for r in b.post.steps if r.loss is not None]
    if not post:
        return CheckResult("loss", Status.SKIP, "no loss logged after the resume")
    pairs = [(s, b.pre[s].loss, v) for s, v in post if s in b.pre and b.pre[s].loss is not None]
    pts = _window(ctx)
    window = [v for _, v in pts]
    ref = {s: p for s, p, _ in pairs}
    nums: dict[str, int | float | str | None] = {"overlap": len(pairs), "deterministic": ctx.deterministic}
    head = post[: opt.spike_window]
    if ref:
        sigma = diff_sigma(window)
        resid = [(s, v - ref[s]) for s, v in head if s in ref]
        basis = Basis.OVERLAP
    else:
        # No overlap: the robust local trend, held at N+1 (extrapolating a falling line would call every
        # flattening loss a jump); the noise is the spread about that trend, never below the step-to-step jitter.
        slope, icpt = theil_sen(pts) if len(pts) >= 3 else (0.0, math.nan)
        at = b.restored_step + 1
        level = icpt + slope * at
        spread = robust_sigma([v - (icpt + slope * s) for s, v in pts]) if len(pts) >= 3 else math.nan
        sigma = max(spread, diff_sigma(window) / math.sqrt(2)) if len(pts) >= 4 else math.nan
        resid = [(s, v - level) for s, v in head]
        basis = Basis.TRAJECTORY
        if math.isfinite(level):
            nums.update(trend_level=level, trend_slope=slope, trend_window=len(pts))
    if not math.isnan(sigma):
        nums["noise_sigma"] = sigma
    finite_sigma = not math.isnan(sigma) and sigma > 0
    shift = spike = drop = False
    med_z = max_z = 0.0
    if finite_sigma:
        zs = [r / sigma for _, r in resid if math.isfinite(r)]
        if zs:
            med_z, max_z = median(zs), max(zs)
            nums.update(median_z=med_z, max_z=max_z, window=len(zs))
            shift = med_z > opt.level_z and len(zs) >= 3
            spike = max_z > opt.spike_z
            drop = bool(ref) and med_z < -opt.level_z and len(zs) >= 3
            nums["shifted"] = shift or spike
    sure = (
        Confidence.HIGH
        if med_z > 2 * opt.level_z
        or max_z > 2 * opt.spike_z
        or (not shift and not spike and len(window) >= 15)
        else Confidence.LOW
    )
    nonfinite = [(s, v) for s, v in head if not math.isfinite(v)]
    if nonfinite and all(math.isfinite(x) for x in window):
        nums["first_nonfinite"] = nonfinite[0][0]
        return CheckResult(
            "loss",
            Status.FAIL,
            f"loss is {nonfinite[0][1]} at step {nonfinite[0][0]} right after the resume",
            Cause.OPTIMIZER_LOST,
            nums,
        ).judged(basis, Confidence.EXACT)

    if ctx.deterministic and pairs:
        diff = [(s, p, v) for s, p, v in pairs if p != v]
        if not diff:
            nums.update(first_step=pairs[0][0], last_step=pairs[-1][0])
            return CheckResult(
                "loss", Status.PASS, f"{len(pairs)} overlapping steps equal bit for bit", None, nums
            ).judged(Basis.OVERLAP, Confidence.EXACT)
        s, p, v = diff[0]
        nums.update(first_mismatch=s, pre=p, post=v, mismatched=len(diff))
        first_is_exact = pairs[0][1] == pairs[0][2] and pairs[0][0] == b.restored_step + 1
        if shift or spike:
            cause, why = Cause.OPTIMIZER_LOST, "level shift after the resume"
        elif first_is_exact and s == b.restored_step + 2:
            # Same weights, data and RNG at N+1, yet the first update differs: the optimizer state.
            cause, why = Cause.OPTIMIZER_LOST, "first loss exact, first update differs"
        elif s == b.restored_step + 1:
            cause, why = Cause.MODEL_STATE, "first loss after restore (before any update) differs"
        else:
            cause, why = Cause.LOSS_DIVERGED, "losses diverge"
        return CheckResult(
            "loss",
            Status.FAIL,
            f"step {s}: loss {v!r} vs {p!r} before the crash ({len(diff)}/{len(pairs)} differ); {why}",
            cause,
            nums,
        ).judged(Basis.OVERLAP, Confidence.EXACT)
    src = (
        f"{len(pairs)} overlapping steps" if pairs else f"local trend of {len(pts)} steps before the boundary"
    )
    if not finite_sigma:
        return CheckResult(
            "loss", Status.SKIP, "too few pre-boundary losses to calibrate the noise", None, nums
        )
    if shift or spike:
        what = "spike" if spike and not shift else "level shift"
        return CheckResult(
            "loss",
            Status.FAIL,
            f"loss {what} after resume: median z {nums['median_z']:.1f}, max z {nums['max_z']:.1f} "
            f"over {nums['window']} steps (noise sigma {sigma:.3g}, against the {src})",
            Cause.OPTIMIZER_LOST,
            nums,
        ).judged(basis, sure)
    if drop:
        return CheckResult(
            "loss",
            Status.WARN,
            f"loss below the pre-crash run after resume: median z {nums['median_z']:.1f}",
            Cause.LOSS_DROP,
            nums,
        ).judged(basis, sure)
    return CheckResult(
        "loss",
        Status.PASS,
        f"within noise against {src}: median z {nums.get('median_z', 0):.1f}, "
        f"max z {nums.get('max_z', 0):.1f} (sigma {sigma:.3g})",
        None,
        nums,
    ).judged(basis, sure)
