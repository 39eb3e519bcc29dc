"""Loss continuity: bitwise in deterministic mode, else a paired test on the overlap or a level-shift test.

With overlap (a crash at M after a checkpoint at N leaves N+1..M logged twice) each resumed step is paired
with the same step before the crash: same batch, same weights if the restore was right, so their difference
carries only the run's nondeterminism, never the batch-to-batch noise.  The paired differences must not move
the loss level: their mean is a discontinuity when it exceeds both a documented floor (``paired_floor``,
relative to the loss) and ``paired_t`` standard errors of the differences' own spread.  A consistent shift
across the overlap is therefore found even when every single step lies inside the batch noise.

Without overlap the first post-resume losses are compared with the robust local trend before N, in standard
errors of their median, with the noise from a trend that allows level changes and a drop judged against the
run's own epoch pattern (:mod:`ckpt.resume.checks.level`).

The check names a *cause* only from facts (deterministic mode: the first loss after the restore is exact, the
first update differs, and the restore record or the checkpoint shows an optimizer counter other than N, or no
counter says and the sessions themselves recorded a deterministic run); otherwise it names the symptom (``loss level +12% after restore``) and what to check.
"""

from __future__ import annotations

import math

from ckpt.resume.boundaries import Boundary
from ckpt.resume.checks.base import Basis, Cause, CheckResult, Confidence, Status
from ckpt.resume.checks.context import CheckContext
from ckpt.resume.checks.level import level_test
from ckpt.resume.checks.stats import diff_sigma, median
from ckpt.words import count


def _window(ctx: CheckContext) -> list[tuple[int, float]]:
    """The last ``noise_window`` finite (step, loss) pairs up to N: the local calibration span."""
    b = ctx.boundary
    n = b.restored_step
    steps = sorted(s for s in b.pre if s <= n)
    pts = [(s, b.pre[s].loss) for s in steps if b.pre[s].loss is not None and math.isfinite(b.pre[s].loss)]
    return pts[-ctx.options.noise_window :]  # type: ignore[return-value]


def _optimizer_restored(ctx: CheckContext) -> bool:
    """The restore record shows the live optimizer's counter equal to N: its state arrived."""
    return _optimizer_fact(ctx) is True


def _optimizer_fact(ctx: CheckContext) -> bool | None:
    """What the facts say about the live optimizer state after the restore: True restored (the restore
    record's live counter equals N), False lost (that counter, or one stored in the checkpoint, is not N),
    None when no fact says (a checkpoint holding N does not show that the load kept it)."""
    n = ctx.boundary.restored_step
    r = ctx.boundary.restore
    if r is not None and r.optimizer_step is not None and not r.inferred:
        return r.optimizer_step == n
    counters = list((ctx.facts.optimizer_steps or {}).values()) if ctx.facts is not None else []
    if any(c != n for c in counters):
        return False
    return None


def _claims_determinism(ctx: CheckContext) -> bool:
    """The training sessions themselves recorded a deterministic run (the ledger's ``deterministic``), so a
    differing first update is the restore's doing; ``--deterministic`` forced on a log is only the user's word."""
    b = ctx.boundary
    envs = [b.post.env] + ([b.dead.env] if b.dead is not None else [])
    return all(env.get("deterministic") is True for env in envs)


def _what_to_check(ctx: CheckContext) -> str:
    opt = (
        f"the optimizer state was restored (step counter {ctx.boundary.restored_step}); "
        if _optimizer_restored(ctx)
        else ""
    )
    others = "model weights (a strict=False load, a stale async save) and the data position"
    if not opt:
        others = "model weights (a strict=False load, a stale async save), the optimizer state and the data position"
    return f"{opt}check the {others}"


def _symptom(shift: float, level: float) -> str:
    """``loss level +12% after restore`` (absolute when the level is ~0)."""
    if abs(level) > 1e-12:
        return f"loss level {100 * shift / abs(level):+.3g}% after restore"
    return f"loss level {shift:+.3g} after restore"


T_9975 = (127.3, 14.09, 7.453, 5.598, 4.773, 4.317, 4.029, 3.833, 3.69, 3.581, 3.497, 3.428, 3.372, 3.326, 3.286,
          3.252, 3.222, 3.197, 3.174, 3.153)  # fmt: skip
"""Student t quantiles at 0.9975 for 1..20 degrees of freedom (beyond: below ``paired_t``)."""


def drift_robust(d: list[float], paired_t: float) -> tuple[float, float, float]:
    """(drift t, first-step t, critical value) of paired differences that may drift (issue 39).

    Resumed and pre-crash trajectories start from the same weights at N and, on a GPU, drift apart: their
    differences are autocorrelated (lag-1 0.7-0.9), so sd/sqrt(k) understates the mean's error and a clean
    resume fails 12-36% of the time.  Two statistics that hold under any such drift (an AR(1) that starts at
    0 at step N, up to a random walk), each against Student's t at 0.9975 with k-2 degrees of freedom
    (at least ``paired_t``): the mean against its standard error if the differences were a random walk (the
    spread of the step-to-step increments times sqrt((k+1)(2k+1)/6k)), and the first difference against the
    increments' spread: a restore defect is there at N+1, before any update could drift.  On generated
    drifting differences (tests/test_resume_statistics.py) false alarms stay below 1% at every lag-1
    correlation from 0 to 1 and k from 3 to 20.
    """
    k = len(d)
    if k < 3:
        return math.nan, math.nan, math.nan
    inc = [b - a for a, b in zip(d, d[1:], strict=False)]
    m_inc = sum(inc) / len(inc)
    s_inc = math.sqrt(sum((x - m_inc) ** 2 for x in inc) / (len(inc) - 1)) if len(inc) >= 2 else abs(inc[0])
    mean = sum(d) / k
    crit = max(paired_t, T_9975[k - 3] if k - 2 <= len(T_9975) else paired_t)
    if not s_inc > 0:
        big = math.inf if mean != 0 else 0.0
        return big, big, crit
    drift_t = abs(mean) / (s_inc * math.sqrt((k + 1) * (2 * k + 1) / (6 * k)))
    jump_t = abs(d[0]) / s_inc if d[0] * mean > 0 else 0.0
    return drift_t, jump_t, crit


def _paired(ctx: CheckContext, pairs: list[tuple[int, float, float]], nums: dict) -> CheckResult | None:
    """The paired test on the overlap (tolerance mode); None when it cannot judge (nothing finite)."""
    opt = ctx.options
    use = [(s, p, v) for s, p, v in pairs if math.isfinite(p) and math.isfinite(v)][
        : max(opt.spike_window, 20)
    ]
    if not use:
        return None
    d = [v - p for _, p, v in use]
    k = len(d)
    mean = sum(d) / k
    level = median([p for _, p, _ in use])
    floor = opt.paired_floor * abs(level)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (k - 1)) if k >= 2 else math.nan
    se = sd / math.sqrt(k) if k >= 2 else math.nan
    t = (abs(mean) / se if se > 0 else math.inf) if k >= 2 else math.nan
    drift_t, jump_t, crit = drift_robust(d, opt.paired_t)
    window = [v for _, v in _window(ctx)]
    batch_sigma = diff_sigma(window)
    nums.update(
        paired_mean=mean,
        paired_relative=mean / abs(level) if level else None,
        paired_sd=sd if k >= 2 else None,
        paired_t=t if math.isfinite(t) else None,
        drift_t=drift_t if math.isfinite(drift_t) else None,
        first_step_t=jump_t if math.isfinite(jump_t) else None,
        critical_t=crit if math.isfinite(crit) else None,
        paired_floor=floor,
        window=k,
    )
    if math.isfinite(batch_sigma):
        nums["noise_sigma"] = batch_sigma
    # A single step far outside the batch noise is a spike even when the mean stays small.
    spike_at = None
    if math.isfinite(batch_sigma) and batch_sigma > 0:
        big = [(s, v - p) for s, p, v in use[: opt.spike_window] if abs(v - p) > opt.spike_z * batch_sigma]
        spike_at = big[0] if big else None
    # Few pairs: no spread to test against, so only a shift of twice the floor counts.  Otherwise the shift must
    # stand out against a drift of the two trajectories (issue 39): see :func:`drift_robust`.
    strongest = max(drift_t, jump_t) if k >= 3 else math.nan
    # The first resumed step runs the restored weights on the pre-crash run's batch before any update: a
    # correct restore differs there by one forward pass's nondeterminism, far below the floor.  A difference
    # of twice the floor at N+1, in the direction of the mean, is the restore's, whatever drift follows.
    at_restore = use[0][0] == ctx.boundary.restored_step + 1 and d[0] * mean > 0 and abs(d[0]) > 2 * floor
    nums["first_step_relative"] = d[0] / abs(level) if level else None
    shifted = abs(mean) > floor and ((strongest > crit or at_restore) if k >= 3 else abs(mean) > 2 * floor)
    over = f"{count(k, 'overlapping step')} (same steps before the crash)"
    if shifted or spike_at is not None:
        nums["shifted"] = True
        if shifted:
            why = (
                f"{strongest:.1f} standard errors of the run's own nondeterminism allowing for drift "
                f"(critical {crit:.2g}; sd {sd:.3g})"
                if strongest > crit
                else f"already {d[0]:+.4g} at step {use[0][0]}, before any update could drift"
            )
            what = (
                f"{_symptom(mean, level)}: mean paired difference {mean:+.4g} over {over}, {why}"
                if k >= 3 and math.isfinite(strongest)
                else f"{_symptom(mean, level)}: paired difference {mean:+.4g} over {over}"
            )
        else:
            assert spike_at is not None
            what = (
                f"loss spike at step {spike_at[0]} after restore: {spike_at[1]:+.4g} against the same step "
                f"before the crash ({abs(spike_at[1]) / batch_sigma:.0f}x the batch noise)"
            )
        sure = (
            Confidence.HIGH
            if (abs(mean) > 2 * floor and (k < 3 or strongest > 2 * crit or at_restore)) or spike_at
            else Confidence.LOW
        )
        return CheckResult(
            "loss", Status.FAIL, f"{what}; {_what_to_check(ctx)}", Cause.LOSS_SHIFT, nums
        ).judged(Basis.OVERLAP, sure)
    nums["shifted"] = False
    nums["drift_excused"] = abs(mean) > floor and k >= 3 and t > opt.paired_t
    return CheckResult(
        "loss",
        Status.PASS,
        f"paired with {over}: mean difference {mean:+.3g} "
        f"({100 * abs(mean) / abs(level) if level else 0:.2g}% of the loss, floor {100 * opt.paired_floor:.2g}%)",
        None,
        nums,
    ).judged(Basis.OVERLAP, Confidence.HIGH if k >= 3 else Confidence.LOW)


def _same_batch(b: Boundary, step: int) -> bool:
    """Both logs carry the batch digest of ``step`` and they agree: the fact that makes a differing first loss
    the model state's doing rather than the data's."""
    post = next((r for r in b.post.steps if r.step == step), None)
    pre = b.pre.get(step)
    return (
        post is not None
        and pre is not None
        and post.data_digest is not None
        and post.data_digest == pre.data_digest
    )


def _deterministic(ctx: CheckContext, pairs: list[tuple[int, float, float]], nums: dict) -> CheckResult:
    """Bitwise: any difference on the overlap fails; which step differs first says what it was."""
    b = ctx.boundary
    diff = [(s, p, v) for s, p, v in pairs if p != v]
    if not diff:
        nums.update(first_step=pairs[0][0], last_step=pairs[-1][0])
        return CheckResult(
            "loss", Status.PASS, f"{count(len(pairs), 'overlapping step')} equal bit for bit", None, nums
        ).judged(Basis.OVERLAP, Confidence.EXACT)
    s, p, v = diff[0]
    nums.update(first_mismatch=s, pre=p, post=v, mismatched=len(diff))
    first_is_exact = pairs[0][1] == pairs[0][2] and pairs[0][0] == b.restored_step + 1
    if first_is_exact and s == b.restored_step + 2:
        # Same weights, data and RNG at N+1, yet the first update differs: the optimizer state, the LR, the
        # gradient path, or a run that is not bitwise reproducible.  Only a counter says which (issue 39).
        known = _optimizer_fact(ctx)
        if known is False or (known is None and _claims_determinism(ctx)):
            cause, why = (
                Cause.OPTIMIZER_LOST,
                "first loss exact, first update differs"
                + (
                    ", and the optimizer's step counter was not restored"
                    if known is False
                    else " in a run its sessions record as deterministic"
                ),
            )
        elif known:
            cause, why = (
                Cause.LOSS_DIVERGED,
                (
                    "first loss exact, first update differs although the optimizer's step counter was restored; "
                    "check the LR, the gradient path, and whether the run is bitwise reproducible"
                ),
            )
        else:
            cause, why = (
                Cause.LOSS_DIVERGED,
                (
                    "first loss exact, first update differs: the optimizer state, the LR, the gradient path, or "
                    "a run that is not bitwise reproducible (no restore record or checkpoint counter says which)"
                ),
            )
    elif s == b.restored_step + 1 and _same_batch(b, s):
        cause, why = (
            Cause.MODEL_STATE,
            "first loss after restore (before any update) differs on the same batch",
        )
    elif s == b.restored_step + 1:
        cause, why = (
            Cause.LOSS_DIVERGED,
            "first loss after restore (before any update) differs: the model state or the batch (no batch "
            "digest says it was the same)",
        )
    else:
        cause, why = Cause.LOSS_DIVERGED, "losses diverge"
    return CheckResult(
        "loss",
        Status.FAIL,
        f"step {s}: loss {v!r} vs {p!r} before the crash ({len(diff)}/{len(pairs)} differ); {why}",
        cause,
        nums,
    ).judged(Basis.OVERLAP, Confidence.EXACT)


def check_loss(ctx: CheckContext) -> CheckResult:
    b = ctx.boundary
    post = [(r.step, r.loss) for r in b.post.steps if r.loss is not None]
    if not post:
        return CheckResult("loss", Status.SKIP, "no loss logged after the resume")
    pairs = [(s, b.pre[s].loss, v) for s, v in post if s in b.pre and b.pre[s].loss is not None]
    nums: dict[str, int | float | str | None] = {"overlap": len(pairs), "deterministic": ctx.deterministic}
    window = [v for _, v in _window(ctx)]
    head = post[: ctx.options.spike_window]
    nonfinite = [(s, v) for s, v in head if not math.isfinite(v)]
    if nonfinite and all(math.isfinite(x) for x in window):
        nums["first_nonfinite"] = nonfinite[0][0]
        return CheckResult(
            "loss",
            Status.FAIL,
            f"loss is {nonfinite[0][1]} at step {nonfinite[0][0]} right after the resume; {_what_to_check(ctx)}",
            Cause.LOSS_SHIFT,
            nums,
        ).judged(Basis.OVERLAP if pairs else Basis.TRAJECTORY, Confidence.EXACT)
    if ctx.deterministic and pairs:
        return _deterministic(ctx, pairs, nums)
    if pairs:
        found = _paired(ctx, pairs, nums)
        if found is not None and found.status is Status.PASS and nums.get("drift_excused"):
            # Independent differences would have failed, a drift of the two trajectories explains them: the
            # level test, which compares with the batch noise (far above any drift), decides instead.
            level = level_test(ctx, post, dict(nums), _what_to_check(ctx))
            if level.status is Status.FAIL:
                level.summary += " (the overlap's paired differences alone could be a drift of the two runs)"
                return level
        if found is not None:
            return found
    return level_test(ctx, post, nums, _what_to_check(ctx))
