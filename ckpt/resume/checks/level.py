"""The level-shift test without overlap: do the first resumed losses continue the pre-boundary trend?

The first ``level_window`` losses after N are compared with a robust (Theil-Sen) line through the losses just
before N, in standard errors of their median.  Two things make that honest on real runs:

- *The noise comes from a trend that allows level changes.*  A loss that drops at every epoch start (a model
  memorising its data) or at a curriculum switch has a level change inside the calibration window; one line
  through it inflates the residuals (0.167 against 0.07 within the epoch) and hides a real shift.  The window
  is cut at the epoch starts and phase changes the log names and at level changes found in the losses
  themselves (:func:`breaks`); sigma is the MAD of the residuals of a line per piece, and the level at N+1
  comes from the last piece.
- *A drop is judged against the run's own pattern, not let through by its sign.*  A loader that restarts at
  the start of a memorised epoch drops the loss by a quarter mid-epoch.  A drop at N+1 passes where the
  position fields say an epoch starts there and the run's earlier epoch starts dropped it as much; it is
  "cannot tell" where the logs show an earlier drop of that size but no epochs, or a scheduled change at the
  boundary; it fails otherwise.  A rise is held to the flat level at N+1 (a flattening loss is no jump), a
  drop to the line continued (a falling loss is no drop).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ckpt.resume.checks.base import Basis, Cause, CheckResult, Confidence, Status
from ckpt.resume.checks.context import CheckContext
from ckpt.resume.checks.position import epoch_index, epoch_starts
from ckpt.resume.checks.scheduled import cannot_tell, scheduled_changes
from ckpt.resume.checks.stats import diff_sigma, median, robust_sigma, theil_sen
from ckpt.words import count

MEDIAN_SE = 1.2533
"""Standard error of a median of k Gaussian values, in units of sigma / sqrt(k)."""
TREND_STEPS = 30
"""The trend's level at N+1 comes from the losses of the last this-many steps ..."""
TREND_MIN_POINTS = 5
"""... or from at least this many logged losses (every k-th step logged: a longer stretch)."""
MIN_PIECE = 4
"""A level change found in the losses leaves at least this many points on each side."""
BREAK_GAIN = 0.75
"""A level change is accepted when cutting there shrinks the residual sigma to below this fraction ..."""
BREAK_JUMP = 5.0
"""... and the jump is over this many of the remaining sigmas."""
PATTERN_FACTOR = 2.0
"""A drop at an epoch start fits the run's pattern when it is at most this many times its largest earlier one."""

Points = list[tuple[int, float]]


def _resid(piece: Points) -> list[float]:
    if len(piece) < 3:
        return []
    slope, icpt = theil_sen(piece)
    return [v - (icpt + slope * s) for s, v in piece]


def _pieces(pts: Points, cuts: Sequence[int]) -> list[Points]:
    bounds = [0, *sorted(set(cuts)), len(pts)]
    return [pts[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _sigma(pts: Points, cuts: Sequence[int]) -> float:
    res = [r for piece in _pieces(pts, cuts) for r in _resid(piece)]
    return robust_sigma(res) if len(res) >= 3 else math.nan


def breaks(pts: Points, known: Sequence[int] = (), most: int = 2) -> list[int]:
    """Indices into ``pts`` where the level changes: the ``known`` ones (epoch starts, phase changes) and up to
    ``most`` found greedily, each the cut that shrinks the pooled residual sigma most, kept only when it
    shrinks it below ``BREAK_GAIN`` and the jump there exceeds ``BREAK_JUMP`` sigmas."""
    cuts = sorted({k for k in known if 0 < k < len(pts)})
    for _ in range(most):
        base = _sigma(pts, cuts)
        best: tuple[float, int] | None = None
        for k in range(MIN_PIECE, len(pts) - MIN_PIECE + 1):
            if any(abs(k - c) < MIN_PIECE for c in cuts):
                continue
            sig = _sigma(pts, [*cuts, k])
            if best is None or sig < best[0]:
                best = (sig, k)
        if best is None or not (best[0] < BREAK_GAIN * base):
            break
        k = best[1]
        if abs(_jump(pts, k)) <= BREAK_JUMP * best[0]:
            break
        cuts = sorted([*cuts, k])
    return cuts


def _jump(pts: Points, k: int) -> float:
    """The level change at index ``k``: the median of the points after it minus the median before (each
    piece up to ``MIN_PIECE`` points)."""
    return median([v for _, v in pts[k : k + MIN_PIECE]]) - median(
        [v for _, v in pts[max(0, k - MIN_PIECE) : k]]
    )


def _window(ctx: CheckContext) -> Points:
    b = ctx.boundary
    n = b.restored_step
    steps = sorted(s for s in b.pre if s <= n)
    pts = [(s, b.pre[s].loss) for s in steps if b.pre[s].loss is not None and math.isfinite(b.pre[s].loss)]
    return pts[-ctx.options.noise_window :]  # type: ignore[return-value]


def _known_cuts(ctx: CheckContext, pts: Points) -> list[int]:
    """Indices of ``pts`` where the log names a level change: an epoch start or a phase change."""
    b = ctx.boundary
    recs = [b.pre[s] for s in sorted(b.pre) if s <= b.restored_step]
    steps = set(epoch_starts(recs))
    for r0, r1 in zip(recs, recs[1:], strict=False):
        if r0.phase is not None and r1.phase is not None and r0.phase != r1.phase:
            steps.add(r1.step)
    cuts = {next((i for i, (t, _) in enumerate(pts) if t >= s), len(pts)) for s in steps}
    return sorted(c for c in cuts if 0 < c < len(pts))


def _epoch_pattern(ctx: CheckContext, drop: float) -> tuple[str, str] | None:
    """Whether the resumed first step starts an epoch, and how the loss moved at the run's earlier epoch
    starts: (verdict, text) with verdict ``fits`` / ``first`` / ``mid``; None without epoch fields."""
    b = ctx.boundary
    recs = [b.pre[s] for s in sorted(b.pre) if s <= b.restored_step]
    before = [r for r in recs if r.epoch is not None]
    after = next((r for r in b.post.steps if r.epoch is not None), None)
    if not before or after is None:
        return None
    integral = all(float(r.epoch).is_integer() for r in [*before, after])  # type: ignore[arg-type]
    starts = epoch_index(after.epoch, integral) > epoch_index(before[-1].epoch, integral)  # type: ignore[arg-type]
    losses = [(r.step, r.loss) for r in recs if r.loss is not None and math.isfinite(r.loss)]
    earlier = []
    for s in epoch_starts(recs):
        i = next((j for j, (t, _) in enumerate(losses) if t >= s), None)
        if i is None or i < 2 or len(losses) - i < 2:
            continue
        level = median([v for _, v in losses[max(0, i - MIN_PIECE) : i]])
        moved = median([v for _, v in losses[i : i + MIN_PIECE]]) - level
        earlier.append((s, moved / abs(level) if level else 0.0))
    said = ", ".join(f"{100 * m:+.0f}% at step {s}" for s, m in earlier) or "none before"
    if not starts:
        return (
            "mid",
            f"step {after.step} is inside an epoch (epoch {after.epoch:g}); the run's epoch starts: {said}",
        )
    drops = [-m for _, m in earlier if m < 0]
    if drops and -drop <= PATTERN_FACTOR * max(drops):
        return (
            "fits",
            f"step {after.step} starts an epoch and the loss dropped at the run's earlier epoch starts ({said})",
        )
    return "first", f"step {after.step} starts an epoch; the run's earlier epoch starts: {said}"


def _sharpest(pts: Points, i: int) -> int:
    """The step near index ``i`` with the largest single-step fall: where a level change found by medians of a
    few points on either side really happened."""
    near = range(max(1, i - MIN_PIECE + 1), min(len(pts), i + MIN_PIECE))
    return pts[max(near, key=lambda t: pts[t - 1][1] - pts[t][1])][0]


def _local(pts: Points, i: int, sigma: float) -> float:
    """The noise around index ``i`` (a loss's noise shrinks with its level), at least ``sigma``."""
    near = diff_sigma([v for _, v in pts[max(0, i - 2 * MIN_PIECE) : i + 2 * MIN_PIECE]]) / math.sqrt(2)
    return max(sigma, near) if math.isfinite(near) else sigma


def _drops(ctx: CheckContext, sigma: float) -> tuple[list[int], int | None]:
    """Steps where the loss dropped before N by over ``BREAK_JUMP`` sigma, and their period when they recur at
    one (to within two steps: a drop is located by medians of a few points on either side)."""
    b = ctx.boundary
    pts = [(s, b.pre[s].loss) for s in sorted(b.pre) if s <= b.restored_step and b.pre[s].loss is not None]
    pts = [(s, v) for s, v in pts if math.isfinite(v)]  # type: ignore[arg-type]
    jumps = {i: _jump(pts, i) for i in range(MIN_PIECE, len(pts) - 1)}  # type: ignore[arg-type]
    found = [
        _sharpest(pts, i)  # type: ignore[arg-type]
        for i, j in jumps.items()
        if j < -BREAK_JUMP * _local(pts, i, sigma) and j <= min(jumps.get(t, 0.0) for t in range(i - MIN_PIECE, i + MIN_PIECE + 1))
    ]
    found = sorted(set(found))
    gaps = [t - s for s, t in zip(found, found[1:], strict=False)]
    period = round(median(gaps)) if gaps and max(gaps) - min(gaps) <= 2 else None
    return found, period


def _drop_grid(ctx: CheckContext, sigma: float) -> str | None:
    """Without epoch fields: the run's earlier drops in words when one could be an epoch start the log does not
    name at N+1 (a single earlier drop, or drops that recur at a period N+1 falls on); else None."""
    found, period = _drops(ctx, sigma)
    if not found:
        return None
    nxt = ctx.boundary.post.steps[0].step
    on_grid = period is not None and min((nxt - found[-1]) % period, -(nxt - found[-1]) % period) <= 1
    if len(found) == 1 or on_grid:
        every = f" every {period} steps" if period else ""
        return f"the loss dropped as much at step {', '.join(map(str, found))}{every} before, with no epoch logged"
    return None


def _next_change(ctx: CheckContext, post: Points, sigma: float) -> int | None:
    """The first resumed step after the first one where the run changes its level on purpose: an epoch start
    (position fields) or a phase change, else the next drop of a recurring period (no epoch logged).  The
    level test stops before it: the next epoch's level is no evidence about this restore."""
    recs = [r for r in ctx.boundary.post.steps if r.loss is not None]
    first = post[0][0]
    marks = [s for s in epoch_starts(recs) if s > first]
    marks += [r1.step for r0, r1 in zip(recs, recs[1:], strict=False) if r0.phase != r1.phase and r1.step > first]
    if not any(r.epoch is not None for r in recs):
        found, period = _drops(ctx, sigma)
        if period is not None:
            nxt = found[-1] + period * ((first - found[-1]) // period + 1)
            marks.append(nxt - 1 if nxt - 1 > first else nxt + period - 1)
    return min(marks, default=None)


def _symptom(shift: float, level: float) -> str:
    if abs(level) > 1e-12:
        return f"loss level {100 * shift / abs(level):+.3g}% after restore"
    return f"loss level {shift:+.3g} after restore"


def level_test(ctx: CheckContext, post: Points, nums: dict, what_to_check: str) -> CheckResult:
    """The test itself (see the module docstring); ``what_to_check`` ends a failure's summary."""
    opt = ctx.options
    pts = _window(ctx)
    if len(pts) < 4:
        return CheckResult(
            "loss", Status.SKIP, "too few pre-boundary losses to calibrate the noise", None, nums
        )
    n = ctx.boundary.restored_step
    jitter = diff_sigma([v for _, v in pts]) / math.sqrt(2)
    known = _known_cuts(ctx, pts)
    if math.isfinite(jitter) and jitter > 0:  # drops the losses show (an epoch start the log does not name)
        known += [i for i, (s, _) in enumerate(pts) if s in set(_drops(ctx, jitter)[0]) and i > 0]
    cuts = breaks(pts, known)
    last = _pieces(pts, cuts)[-1]
    near = [(s, v) for s, v in last if s > n - TREND_STEPS] or last
    near = near if len(near) >= TREND_MIN_POINTS else last[-TREND_MIN_POINTS:]
    slope, icpt = theil_sen(near) if len(near) >= 3 else (0.0, median([v for _, v in near]))
    at = n + 1
    level = icpt + slope * at
    spread = _sigma(pts, cuts)
    sigma = max(x for x in (spread, jitter, 0.0) if math.isfinite(x))
    nums.update(trend_level=level, trend_slope=slope, trend_window=len(near), noise_sigma=sigma)
    if cuts:
        nums["level_changes_before"] = ", ".join(str(pts[k][0]) for k in cuts)
    stop = _next_change(ctx, post, sigma)
    if stop is not None and sum(1 for s, _ in post if s < stop) >= 3:
        post = [(s, v) for s, v in post if s < stop]
        nums["level_stops_at"] = stop
    horizon = [(s, v) for s, v in post if s <= n + opt.level_window] or post[:1]
    horizon = horizon if len(horizon) >= 3 else post[:3]
    head = [(s, v) for s, v in horizon[: opt.level_window] if math.isfinite(v)]
    if not head or not sigma > 0:
        return CheckResult("loss", Status.SKIP, "no finite loss to compare after the resume", None, nums)
    k, m = len(head), len(near)
    up = median([v - level for _, v in head])
    xs = [s for s, _ in near]
    mean_x = sum(xs) / m
    sxx = sum((x - mean_x) ** 2 for x in xs)
    # a drop is measured from the line continued where it falls significantly (a falling loss keeps falling);
    # a slope within two of its standard errors of flat is noise, and the level is held
    falling = sxx > 0 and slope < -2 * sigma / math.sqrt(sxx)
    flat = sxx > 0 and abs(slope) <= 2 * sigma / math.sqrt(sxx)
    lever = (at - mean_x) ** 2 / sxx if sxx > 0 else 0.0
    se = sigma * math.sqrt(MEDIAN_SE**2 / k + 1 / m + lever)
    if falling:
        mid = median([s for s, _ in head])
        down = median([v - min(level, icpt + slope * s) for s, v in head])
        se_down = sigma * math.sqrt(MEDIAN_SE**2 / k + 1 / m + (mid - mean_x) ** 2 / sxx)
    elif flat:  # no trend to extrapolate: the level before is the median of the piece
        down = median([v for _, v in head]) - median([v for _, v in near])
        se_down = sigma * MEDIAN_SE * math.sqrt(1 / k + 1 / m)
    else:
        down, se_down = up, se
    z, z_down = up / se, down / se_down
    top = max(head, key=lambda x: x[1] - level)
    spike_z = (top[1] - level) / sigma
    nums.update(median_shift=up, level_z=z, drop_z=z_down, max_z=spike_z, window=k)
    src = f"the trend of the last {count(m, 'logged step')} before the boundary"
    shift = z > opt.level_z and k >= 3
    spike = spike_z > opt.spike_z
    dropped = z_down < -opt.level_z and k >= 3 and not shift
    nums["shifted"] = shift or spike or dropped
    sure = (
        Confidence.HIGH if max(z, -z_down) > 2 * opt.level_z or spike_z > 2 * opt.spike_z else Confidence.LOW
    )
    scheduled = scheduled_changes(ctx.boundary)
    if shift or spike:
        if shift:
            what = (
                f"{_symptom(up, level)}: median of the first {count(k, 'step')} {up:+.4g} above {src}, "
                f"{z:.1f} standard errors (noise sigma {sigma:.3g})"
            )
        else:
            what = f"loss spike at step {top[0]} after restore: {spike_z:.0f}x the noise sigma {sigma:.3g} of {src}"
        if scheduled:
            return cannot_tell(what, scheduled, nums).judged(Basis.TRAJECTORY, Confidence.LOW)
        return CheckResult("loss", Status.FAIL, f"{what}; {what_to_check}", Cause.LOSS_SHIFT, nums).judged(
            Basis.TRAJECTORY, sure
        )
    if dropped:
        return _judge_drop(ctx, pts, cuts, down, level, z_down, sigma, src, nums, scheduled, sure, k)
    return CheckResult(
        "loss",
        Status.PASS,
        f"level continues {src}: median shift {up:+.3g} ({z:+.1f} standard errors), "
        f"max step {spike_z:.1f} sigma (sigma {sigma:.3g})",
        None,
        nums,
    ).judged(Basis.TRAJECTORY, Confidence.HIGH if m >= 15 else Confidence.LOW)


def _judge_drop(
    ctx: CheckContext,
    pts: Points,
    cuts: list[int],
    down: float,
    level: float,
    z: float,
    sigma: float,
    src: str,
    nums: dict,
    scheduled: list[str],
    sure: Confidence,
    k: int,
) -> CheckResult:
    """A drop beyond ``level_z``: it passes where it fits the run's epoch pattern, is "cannot tell" where a
    scheduled change or an earlier unexplained drop of its size could be the reason, and fails otherwise."""
    what = (
        f"{_symptom(down, level)}: median of the first {count(k, 'step')} {down:+.4g} below {src}, "
        f"{-z:.1f} standard errors (noise sigma {sigma:.3g})"
    )
    rel = down / abs(level) if level else 0.0
    pattern = _epoch_pattern(ctx, rel)
    if pattern is not None and pattern[0] == "fits":
        nums["epoch_pattern"] = pattern[1]
        return CheckResult("loss", Status.PASS, f"{what}; {pattern[1]}", None, nums).judged(
            Basis.TRAJECTORY, Confidence.HIGH
        )
    if scheduled or (pattern is not None and pattern[0] == "first"):
        return cannot_tell(what, scheduled + ([pattern[1]] if pattern else []), nums).judged(
            Basis.TRAJECTORY, Confidence.LOW
        )
    if pattern is None:
        grid = _drop_grid(ctx, sigma)
        if grid is not None:
            return cannot_tell(what, [grid], nums).judged(Basis.TRAJECTORY, Confidence.LOW)
    why = f"; {pattern[1]}" if pattern else ""
    return CheckResult(
        "loss",
        Status.FAIL,
        f"{what}{why}: the resumed run sees easier data than the run before it (data restarted or repeated?); "
        "check the data position",
        Cause.LOSS_DROP,
        nums,
    ).judged(Basis.TRAJECTORY, sure)
