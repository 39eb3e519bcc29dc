"""Compare the loss curves of two runs of the same job, e.g. the Trainium and the GPU run of a migration.

Two runs with the same data split, order, tokenizer and settings differ only by numerics (precision, kernel
and reduction order, stochastic rounding).  Their *losses* may then differ, but by much less than the loss
moves from one batch to the next; their *learning rates* and *data digests* are functions of the step alone
and must be equal exactly.  So the comparison is:

- **Effective curves.**  Each run is reduced to what it finally trained: for every step, the record of the
  latest segment that logged it (after a resume, the resumed session's value), via
  :func:`ckpt.resume.continuity.effective_history`.  The curves are aligned on the steps both logged.
- **Exact settings.**  LR equal at every common step (at the coarser precision of the two logs, so a float32
  TensorBoard scalar equals the float64 ledger value it came from), data digests equal (same batches, same
  order), tokenizer ids equal.  A difference there makes the comparison not like for like: it is reported
  with the first step where it shows and fails the comparison, whatever the losses do.
- **Loss within tolerance.**  The difference ``d = loss_B - loss_A`` per step (run A is the reference) is
  checked against a band.  By default the band is calibrated from the runs themselves: the *noise floor*
  ``sigma = sqrt((s_A**2 + s_B**2) / 2)``, with ``s`` each run's robust (median/MAD) sigma of step-to-step
  loss changes, is the spread of the difference between two independent noisy evaluations of one step;
  runs that saw the same batches differ by much less.  The band is ``k * sigma`` (``k`` = 5 by default) plus
  the rounding of the logged values (float32 scalars, HF's 4 decimals).  ``--tolerance`` (absolute) or
  ``--rtol`` (relative to ``|loss_A|``) replace it.  A step outside the band is a divergence.
- **Drift.**  A slow separation stays inside a per-step band for a long time, so the trend of the
  difference (its median over the last ``window`` common steps) is also tested.  In calibrated mode it is
  significant above ``k`` standard errors of a median of independent noise, ``k * 1.2533 * sigma /
  sqrt(window)``; with an explicit tolerance the drift must stay within that tolerance.

Exit codes as for every ckpt command: 0 the curves agree and the settings match, 1 they diverge or a setting
differs, 2 bad input.

This module computes the :class:`Comparison` and its JSON; :mod:`ckpt.resume.environment` summarises each
run's environment, :mod:`ckpt.resume.compare_report` puts the result into words, and
:mod:`ckpt.resume.compare_plot` draws it.  (A little over 450 lines, on purpose: the statistics and the
result fields that carry them change together, so they stay in one file, as ``verify_run`` and
``Verification`` do.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ckpt.resume.checks.stats import diff_sigma, median
from ckpt.resume.continuity import effective_history
from ckpt.resume.environment import env_differences, env_summary, last_env, run_tokenizer
from ckpt.resume.errors import RunInputError
from ckpt.resume.model import Run, StepRecord

Band = Callable[[float, float], float]
"""The per-step tolerance as a function of (loss A, loss B) at that step."""

DEFAULT_K = 5.0
"""Band width in noise floors: same-batch runs differ by a small fraction of one floor, so 5 floors leaves a
wide margin for numerics while a different schedule, data order or a spike still shows."""

DEFAULT_WINDOW = 50
"""Steps in the trailing window whose median difference is the drift estimate."""

MEDIAN_SE = math.sqrt(math.pi / 2)
"""Standard error of a median of n Gaussian samples is ``1.2533 * sigma / sqrt(n)``."""

EXIT_AGREE = 0
EXIT_DIVERGE = 1


# -- results ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class RunSide:
    """What the comparison needs from one run: its effective curve and its identity."""

    label: str
    run: Run
    curve: dict[int, StepRecord]
    env: dict[str, object]
    tokenizer_id: str | None
    noise_floor: float = math.nan

    def to_json(self) -> dict[str, object]:
        return {
            "label": self.label,
            "path": self.run.path,
            "source": self.run.source,
            "precision": self.run.precision,
            "sessions": len(self.run.sessions),
            "steps": len(self.curve),
            "first_step": min(self.curve) if self.curve else None,
            "last_step": max(self.curve) if self.curve else None,
            "noise_floor": _finite(self.noise_floor),
            "tokenizer_id": self.tokenizer_id,
            "environment": env_summary(self.env),
        }


@dataclass(slots=True)
class ExactCheck:
    """An exact comparison on the common steps (LR or data digests).

    ``status`` is ``equal``, ``different`` or ``not logged``; for data also ``same batches, different
    order``.  ``first_mismatch`` is the first common step where the values differ, ``a``/``b`` their values.
    """

    status: str
    compared: int = 0
    mismatched: int = 0
    first_mismatch: int | None = None
    a: float | str | None = None
    b: float | str | None = None

    @property
    def differs(self) -> bool:
        return self.status not in ("equal", "not logged")

    def to_json(self) -> dict[str, object]:
        return {
            "status": self.status,
            "compared": self.compared,
            "mismatched": self.mismatched,
            "first_mismatch": self.first_mismatch,
            "a": self.a,
            "b": self.b,
        }


@dataclass(slots=True)
class LossStats:
    """Statistics of ``d = loss_B - loss_A`` over the common steps with a loss in both runs."""

    compared: int
    bitwise_equal: bool
    mean_abs_diff: float
    median_abs_diff: float
    max_abs_diff: float
    max_abs_diff_step: int | None
    mean_rel_diff: float
    max_rel_diff: float
    noise_floor: float
    tolerance_mode: str
    k: float
    tolerance: float
    """The band at the last common step (constant unless ``rtol`` or a float32 log scales it)."""
    diverging: list[int] = field(default_factory=list)
    """Steps where ``|d|`` exceeds the band (or one loss is not finite where the other is)."""

    @property
    def first_divergence(self) -> int | None:
        return self.diverging[0] if self.diverging else None

    def to_json(self) -> dict[str, object]:
        return {
            "compared": self.compared,
            "bitwise_equal": self.bitwise_equal,
            "mean_abs_diff": _finite(self.mean_abs_diff),
            "median_abs_diff": _finite(self.median_abs_diff),
            "max_abs_diff": _finite(self.max_abs_diff),
            "max_abs_diff_step": self.max_abs_diff_step,
            "mean_rel_diff": _finite(self.mean_rel_diff),
            "max_rel_diff": _finite(self.max_rel_diff),
            "noise_floor": _finite(self.noise_floor),
            "tolerance_mode": self.tolerance_mode,
            "k": self.k,
            "tolerance": _finite(self.tolerance),
            "diverging_steps": len(self.diverging),
            "first_divergence": self.first_divergence,
            "diverging": self.diverging[:50],
        }


@dataclass(slots=True)
class Drift:
    """The trend of the difference: median of ``d`` over the first and the last ``window`` common steps."""

    window: int
    first: float
    last: float
    threshold: float
    significant: bool

    def to_json(self) -> dict[str, object]:
        return {
            "window": self.window,
            "first": _finite(self.first),
            "last": _finite(self.last),
            "threshold": _finite(self.threshold),
            "significant": self.significant,
        }


@dataclass(slots=True)
class Comparison:
    """The result of :func:`compare_runs`; ``problems`` lists, in words, every reason the runs disagree."""

    a: RunSide
    b: RunSide
    steps: list[int]
    only_a: int
    only_b: int
    lr: ExactCheck
    data: ExactCheck
    loss: LossStats
    drift: Drift
    tokenizer: str
    env_differences: list[tuple[str, object, object]]
    problems: list[str]

    @property
    def agree(self) -> bool:
        return not self.problems

    @property
    def exit_code(self) -> int:
        return EXIT_AGREE if self.agree else EXIT_DIVERGE

    def diff_series(self) -> tuple[list[int], list[float]]:
        """(steps, B - A) for the steps where both logged a loss: what the plot's middle panel shows."""
        xs, ys = [], []
        for s in self.steps:
            la, lb = self.a.curve[s].loss, self.b.curve[s].loss
            if la is not None and lb is not None:
                xs.append(s)
                ys.append(lb - la)
        return xs, ys

    def to_json(self) -> dict[str, object]:
        """Everything as plain JSON types (floats unrounded, NaN as null)."""
        return {
            "verdict": "agree" if self.agree else "diverge",
            "exit_code": self.exit_code,
            "problems": self.problems,
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "steps_compared": len(self.steps),
            "first_step": self.steps[0] if self.steps else None,
            "last_step": self.steps[-1] if self.steps else None,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "lr": self.lr.to_json(),
            "loss": self.loss.to_json(),
            "drift": self.drift.to_json(),
            "data": self.data.to_json(),
            "tokenizer": {"status": self.tokenizer, "a": self.a.tokenizer_id, "b": self.b.tokenizer_id},
            "environment": {
                "a": env_summary(self.a.env),
                "b": env_summary(self.b.env),
                "differences": [{"key": k, "a": va, "b": vb} for k, va, vb in self.env_differences],
            },
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


# -- the comparison --------------------------------------------------------------------------------------
def _resolution(precision: str, value: float) -> float:
    """Largest rounding error of one logged value: half an ulp for float32, half of HF's 4th decimal."""
    if precision == "float32":
        return abs(value) * 2.0**-24
    if precision == "rounded":
        return 5e-5
    return 0.0


def _compare_lr(a: RunSide, b: RunSide, steps: Sequence[int]) -> ExactCheck:
    """LR is a function of the step: equal bit for bit, at float32 when either log stores float32."""
    f32 = "float32" in (a.run.precision, b.run.precision)
    pairs = [(s, a.curve[s].lr, b.curve[s].lr) for s in steps]
    pairs = [(s, x, y) for s, x, y in pairs if x is not None and y is not None]
    if not pairs:
        return ExactCheck("not logged")
    same = (lambda x, y: np.float32(x) == np.float32(y)) if f32 else (lambda x, y: x == y)
    bad = [(s, x, y) for s, x, y in pairs if not same(x, y)]
    if not bad:
        return ExactCheck("equal", len(pairs))
    s, x, y = bad[0]
    return ExactCheck("different", len(pairs), len(bad), s, x, y)


def _compare_data(a: RunSide, b: RunSide, steps: Sequence[int]) -> ExactCheck:
    """Data digests on the steps where both logged one; a shuffle of the same batches is named as such."""
    pairs = [(s, a.curve[s].data_digest, b.curve[s].data_digest) for s in steps]
    pairs = [(s, x, y) for s, x, y in pairs if x is not None and y is not None]
    if not pairs:
        return ExactCheck("not logged")
    bad = [(s, x, y) for s, x, y in pairs if x != y]
    if not bad:
        return ExactCheck("equal", len(pairs))
    s, x, y = bad[0]
    same_set = sorted(x for _, x, _ in pairs) == sorted(y for _, _, y in pairs)
    status = "same batches, different order" if same_set else "different batches"
    return ExactCheck(status, len(pairs), len(bad), s, x, y)


def _band(
    mode: str, k: float, sigma: float, tolerance: float | None, rtol: float | None, a: RunSide, b: RunSide
) -> Band:
    """The per-step band as a function of the two logged losses (see the module docstring)."""

    def band(la: float, lb: float) -> float:
        if mode == "absolute":
            return float(tolerance)  # type: ignore[arg-type]
        if mode == "relative":
            return float(rtol) * abs(la)  # type: ignore[arg-type]
        return k * sigma + _resolution(a.run.precision, la) + _resolution(b.run.precision, lb)

    return band


def compare_runs(
    run_a: Run,
    run_b: Run,
    *,
    tolerance: float | None = None,
    rtol: float | None = None,
    k: float = DEFAULT_K,
    window: int = DEFAULT_WINDOW,
    labels: tuple[str, str] | None = None,
) -> Comparison:
    """Compare run B against run A (the reference) on their common steps.

    ``tolerance`` (absolute) or ``rtol`` (relative to ``|loss_A|``) fix the per-step band; by default it is
    ``k`` noise floors (module docstring).  Raises :class:`RunInputError` when the runs share no step with a
    loss, or when the noise floor cannot be calibrated (fewer than 4 common losses) and no band was given.
    """
    if tolerance is not None and rtol is not None:
        raise RunInputError("pass either --tolerance or --rtol, not both")
    for name, value in (("--tolerance", tolerance), ("--rtol", rtol)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise RunInputError(f"{name} must be a finite number >= 0, got {value}")
    if not (math.isfinite(k) and k > 0):
        raise RunInputError(f"--k must be a positive number, got {k}")
    if window < 2:
        raise RunInputError(f"--window must be at least 2 steps, got {window}")
    la, lb = labels or ("A", "B")
    a = RunSide(la, run_a, effective_history(run_a), last_env(run_a), run_tokenizer(run_a))
    b = RunSide(lb, run_b, effective_history(run_b), last_env(run_b), run_tokenizer(run_b))
    steps = sorted(a.curve.keys() & b.curve.keys())
    loss_steps = [s for s in steps if a.curve[s].loss is not None and b.curve[s].loss is not None]
    if not loss_steps:
        if not steps:
            raise RunInputError(
                f"{run_a.path} (steps {_span(a.curve)}) and {run_b.path} (steps {_span(b.curve)}) "
                "have no step in common"
            )
        raise RunInputError(f"{run_a.path} and {run_b.path} have no common step with a loss in both")

    loss_a = [float(a.curve[s].loss) for s in loss_steps]  # type: ignore[arg-type]
    loss_b = [float(b.curve[s].loss) for s in loss_steps]  # type: ignore[arg-type]
    a.noise_floor, b.noise_floor = diff_sigma(loss_a), diff_sigma(loss_b)
    sigma = math.sqrt((a.noise_floor**2 + b.noise_floor**2) / 2)
    mode = "absolute" if tolerance is not None else "relative" if rtol is not None else "calibrated"
    if mode == "calibrated" and not math.isfinite(sigma):
        raise RunInputError(
            f"{len(loss_steps)} common steps with finite losses are too few to calibrate the noise floor "
            "(need 4); pass --tolerance or --rtol"
        )
    band = _band(mode, k, sigma, tolerance, rtol, a, b)

    diffs: list[float] = []
    rel: list[float] = []
    diverging: list[int] = []
    worst, worst_step = -1.0, None
    for s, x, y in zip(loss_steps, loss_a, loss_b, strict=True):
        if not (math.isfinite(x) and math.isfinite(y)):
            # Both non-finite the same way is agreement (e.g. both overflowed); one alone is a divergence.
            if not (math.isnan(x) and math.isnan(y)) and x != y:
                diverging.append(s)
            continue
        d = y - x
        diffs.append(d)
        if x != 0:
            rel.append(abs(d) / abs(x))
        if abs(d) > worst:
            worst, worst_step = abs(d), s
        if abs(d) > band(x, y):
            diverging.append(s)
    absd = [abs(d) for d in diffs]
    stats = LossStats(
        compared=len(loss_steps),
        bitwise_equal=all(x == y for x, y in zip(loss_a, loss_b, strict=True)),
        mean_abs_diff=sum(absd) / len(absd) if absd else math.nan,
        median_abs_diff=median(absd),
        max_abs_diff=max(absd) if absd else math.nan,
        max_abs_diff_step=worst_step,
        mean_rel_diff=sum(rel) / len(rel) if rel else math.nan,
        max_rel_diff=max(rel) if rel else math.nan,
        noise_floor=sigma,
        tolerance_mode=mode,
        k=k,
        tolerance=band(loss_a[-1], loss_b[-1]),
        diverging=diverging,
    )
    drift = _drift(loss_a, loss_b, window, mode, k, sigma, band, a, b)

    lr = _compare_lr(a, b, steps)
    data = _compare_data(a, b, steps)
    tok = (
        "not logged"
        if a.tokenizer_id is None or b.tokenizer_id is None
        else "equal"
        if a.tokenizer_id == b.tokenizer_id
        else "different"
    )
    problems: list[str] = []
    if lr.differs:
        problems.append(f"LR differs from step {lr.first_mismatch} ({lr.mismatched}/{lr.compared} steps)")
    if data.status != "equal" and data.differs:
        problems.append(
            f"data order differs ({data.status}) from step {data.first_mismatch} "
            f"({data.mismatched}/{data.compared} steps)"
        )
    if tok == "different":
        problems.append(f"tokenizer differs: {a.tokenizer_id} vs {b.tokenizer_id}")
    if diverging:
        problems.append(
            f"loss diverges beyond tolerance from step {diverging[0]} ({len(diverging)}/{len(loss_steps)} steps)"
        )
    if drift.significant:
        problems.append(
            f"loss drifts apart: median difference {drift.last:+.4g} over the last {drift.window} steps "
            f"(threshold {drift.threshold:.3g})"
        )
    return Comparison(
        a=a,
        b=b,
        steps=steps,
        only_a=len(a.curve) - len(steps),
        only_b=len(b.curve) - len(steps),
        lr=lr,
        data=data,
        loss=stats,
        drift=drift,
        tokenizer=tok,
        env_differences=env_differences(a.env, b.env),
        problems=problems,
    )


def _drift(
    loss_a: list[float],
    loss_b: list[float],
    window: int,
    mode: str,
    k: float,
    sigma: float,
    band: Band,
    a: RunSide,
    b: RunSide,
) -> Drift:
    """Median of B - A over the first and the last ``window`` finite common steps, and whether the last one
    is more than the noise (calibrated) or the tolerance (explicit) allows."""
    pairs = [(x, y) for x, y in zip(loss_a, loss_b, strict=True) if math.isfinite(x) and math.isfinite(y)]
    if not pairs:
        return Drift(0, math.nan, math.nan, math.nan, False)
    w = min(window, len(pairs))
    head, tail = pairs[:w], pairs[-w:]
    first = median([y - x for x, y in head])
    last = median([y - x for x, y in tail])
    level_a, level_b = median([x for x, _ in tail]), median([y for _, y in tail])
    if mode == "calibrated":
        threshold = k * MEDIAN_SE * sigma / math.sqrt(w) + _resolution(a.run.precision, level_a)
        threshold += _resolution(b.run.precision, level_b)
    else:
        threshold = band(level_a, level_b)
    return Drift(w, first, last, threshold, abs(last) > threshold)


def _span(curve: Mapping[int, StepRecord]) -> str:
    return f"{min(curve)}..{max(curve)}" if curve else "none"
