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
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckpt.resume.checks.history import NEURON_KEYS, VERSION_KEYS
from ckpt.resume.checks.stats import diff_sigma, median
from ckpt.resume.continuity import effective_history
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

_ENV_IGNORED = frozenset({"hostname", "pid", "tokenizer_id"})
"""Keys that differ between any two processes (or are reported on their own) and say nothing about numerics."""

_DIST_NAMES = {
    "torch_xla": "torch-xla",
    "torch_neuronx": "torch-neuronx",
    "neuronx_cc": "neuronx-cc",
    "neuronx_distributed": "neuronx-distributed",
    "libneuronxla": "libneuronxla",
}


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


# -- environment -----------------------------------------------------------------------------------------
def last_env(run: Run) -> dict[str, object]:
    """The environment of the run's last session that logged one: the process whose steps end the curve."""
    for session in reversed(run.sessions):
        if session.env:
            return dict(session.env)
    return {}


def _tokenizer(run: Run) -> str | None:
    ids = [s.env.get("tokenizer_id") for s in run.sessions if s.env.get("tokenizer_id") is not None]
    return str(ids[-1]) if ids else None


def backend(env: Mapping[str, object]) -> str:
    """``neuron``, ``cuda``, ``xla`` or ``cpu``: an explicit ``backend``/``device`` extra wins; else guessed
    from what is installed (Neuron compiler/runtime packages, then a CUDA build of torch, then torch-xla).
    Installed is not used: a CUDA build of torch run on CPU reads as cuda, so log
    ``extra_env={"backend": ...}`` when it matters."""
    for key in ("backend", "device"):
        if env.get(key):
            return str(env[key])
    if any(env.get(k) for k in NEURON_KEYS if k != "torch_xla"):
        return "neuron"
    if env.get("cuda"):
        return "cuda"
    if env.get("torch_xla"):
        return "xla"
    return "cpu" if env else "unknown"


def env_summary(env: Mapping[str, object]) -> str:
    """One line per run, e.g. ``neuron torch 2.9.0 torch-xla 2.9.0 neuronx-cc 2.21`` or ``cuda 12.8 torch
    2.9.0``: the backend and the versions that change numerics, in the order people name them."""
    if not env:
        return "not logged"
    parts = [backend(env)]
    if parts[0] == "cuda" and env.get("cuda"):
        parts.append(str(env["cuda"]))
    for key in ("torch", *NEURON_KEYS):
        if env.get(key):
            parts.append(f"{_DIST_NAMES.get(key, key)} {env[key]}")
    if env.get("world_size") is not None:
        parts.append(f"world {env['world_size']}")
    return " ".join(parts)


def env_differences(a: Mapping[str, object], b: Mapping[str, object]) -> list[tuple[str, object, object]]:
    """(key, A, B) for every logged setting that differs: versions first, then the rest alphabetically.
    Nothing when either run logged no environment (TensorBoard, CSV): every key would "differ"."""
    if not a or not b:
        return []
    keys = [k for k in VERSION_KEYS if k in a or k in b]
    keys += sorted((set(a) | set(b)) - set(VERSION_KEYS) - _ENV_IGNORED)
    return [(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)]


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
    a = RunSide(la, run_a, effective_history(run_a), last_env(run_a), _tokenizer(run_a))
    b = RunSide(lb, run_b, effective_history(run_b), last_env(run_b), _tokenizer(run_b))
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


# -- output ----------------------------------------------------------------------------------------------
def _g(x: float | None, fmt: str = ".4g") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, fmt)


def _rows(c: Comparison) -> list[tuple[str, str, str]]:
    """(what, verdict, details) rows of the table: the numbers a person needs to trust the verdict."""
    a, b, s = c.a, c.b, c.loss
    rows: list[tuple[str, str, str]] = []
    span = f"{c.steps[0]}..{c.steps[-1]}" if c.steps else "none"
    extra = f"; only in {a.label}: {c.only_a}, only in {b.label}: {c.only_b}" if c.only_a or c.only_b else ""
    rows.append(("steps", "", f"{len(c.steps)} common steps ({span}), {s.compared} with both losses{extra}"))
    if c.lr.status == "not logged":
        rows.append(("learning rate", "skip", "not logged by both runs"))
    elif c.lr.differs:
        rows.append(
            (
                "learning rate",
                "different",
                f"first differs at step {c.lr.first_mismatch}: {a.label} {c.lr.a!r} vs {b.label} {c.lr.b!r} "
                f"({c.lr.mismatched}/{c.lr.compared} steps differ)",
            )
        )
    else:
        rows.append(("learning rate", "equal", f"{c.lr.compared} steps equal bit for bit"))
    how = {
        "calibrated": f"{_g(s.k, 'g')} x noise floor",
        "absolute": "--tolerance",
        "relative": "--rtol x |loss A|",
    }[s.tolerance_mode]
    rows.append(
        (
            "noise floor",
            "",
            f"{_g(s.noise_floor)} (robust sigma of step-to-step changes: {a.label} {_g(a.noise_floor)}, "
            f"{b.label} {_g(b.noise_floor)}); tolerance {_g(s.tolerance)} ({how})",
        )
    )
    if s.bitwise_equal:
        loss_verdict, detail = "equal", f"{s.compared} losses equal bit for bit"
    else:
        loss_verdict = "diverge" if s.diverging else "agree"
        detail = (
            f"|{b.label}-{a.label}| mean {_g(s.mean_abs_diff)}, median {_g(s.median_abs_diff)}, max {_g(s.max_abs_diff)} "
            f"at step {s.max_abs_diff_step}; relative mean {_g(s.mean_rel_diff, '.2e')}, "
            f"max {_g(s.max_rel_diff, '.2e')}"
        )
        if s.diverging:
            detail += f"; {len(s.diverging)} steps beyond tolerance, first at step {s.first_divergence}"
    rows.append(("loss", loss_verdict, detail))
    d = c.drift
    rows.append(
        (
            "drift",
            "significant" if d.significant else "none",
            f"median {b.label}-{a.label} {_g(d.last, '+.4g')} over the last {d.window} steps "
            f"({_g(d.first, '+.4g')} over the first); threshold {_g(d.threshold)}",
        )
    )
    if c.data.status == "not logged":
        rows.append(("data order", "skip", "data digests not logged by both runs"))
    elif c.data.differs:
        rows.append(
            (
                "data order",
                "different",
                f"{c.data.status}: first differs at step {c.data.first_mismatch} "
                f"({c.data.mismatched}/{c.data.compared} steps differ)",
            )
        )
    else:
        rows.append(("data order", "equal", f"same batches in the same order at {c.data.compared} steps"))
    if c.tokenizer == "equal":
        tok_detail = f"both {a.tokenizer_id}"
    elif c.tokenizer == "different":
        tok_detail = f"{a.label}: {a.tokenizer_id} / {b.label}: {b.tokenizer_id}"
    else:
        tok_detail = f"not logged by both runs ({a.label}: {a.tokenizer_id}, {b.label}: {b.tokenizer_id})"
    rows.append(("tokenizer", "skip" if c.tokenizer == "not logged" else c.tokenizer, tok_detail))
    env = f"{a.label}: {env_summary(a.env)} / {b.label}: {env_summary(b.env)}"
    if c.env_differences:
        env += "; differs: " + ", ".join(f"{k} {va} vs {vb}" for k, va, vb in c.env_differences)
    rows.append(("environment", "differs" if c.env_differences else "same", env))
    return rows


_STYLE = {
    "equal": "green",
    "agree": "green",
    "none": "green",
    "same": "green",
    "different": "bold red",
    "diverge": "bold red",
    "significant": "bold red",
    "differs": "yellow",
    "skip": "dim",
}


def render_comparison(c: Comparison, console: Console | None = None) -> None:
    """Print the comparison as one rich table and a one-line verdict."""
    con = console or Console()
    a, b = c.a, c.b
    for side in (a, b):
        r = side.run
        con.print(
            f"[bold]{side.label}[/]: {r.path} ({r.source}, {len(r.sessions)} sessions, "
            f"{len(side.curve)} effective steps, values {r.precision})"
        )
        for note in r.notes:
            con.print(f"[dim]  note: {note}[/]")
    table = Table(
        title=f"{b.label} vs {a.label} (differences are {b.label} - {a.label})", title_justify="left"
    )
    table.add_column("what")
    table.add_column("verdict")
    table.add_column("details", overflow="fold")
    for what, verdict, detail in _rows(c):
        table.add_row(what, Text(verdict, style=_STYLE.get(verdict, "")), detail)
    con.print(table)
    if c.agree:
        con.print(f"[bold green]AGREE[/] over {len(c.steps)} common steps")
    else:
        con.print(f"[bold red]DIVERGE[/]: {'; '.join(c.problems)}")


def plot_comparison(c: Comparison, out: str | os.PathLike[str]) -> None:
    """Loss of both runs, their difference with the tolerance band below, and both LRs: one PNG, drawn with
    the headless Agg backend so it works on clusters without a display."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RunInputError("--plot needs matplotlib: pip install 'ckpt[plot]'") from None
    colour_a, colour_b = "#1f77b4", "#ff7f0e"
    fig, (ax_loss, ax_diff, ax_lr) = plt.subplots(
        3, 1, figsize=(11, 8.5), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.6]}
    )
    for side, colour, lw, alpha in ((c.a, colour_a, 2.4, 0.55), (c.b, colour_b, 1.0, 1.0)):
        steps = sorted(side.curve)
        for ax, attr in ((ax_loss, "loss"), (ax_lr, "lr")):
            pts = [
                (s, getattr(side.curve[s], attr)) for s in steps if getattr(side.curve[s], attr) is not None
            ]
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], color=colour, lw=lw, alpha=alpha, label=side.label
            )
    xs, ds = c.diff_series()
    ax_diff.plot(xs, ds, color="#444444", lw=0.9, label=f"{c.b.label} - {c.a.label}")
    s = c.loss
    if math.isfinite(s.tolerance):
        ax_diff.axhspan(-s.tolerance, s.tolerance, color="green", alpha=0.10, lw=0, label="tolerance")
    ax_diff.axhline(0, color="grey", lw=0.6)
    div = set(s.diverging)
    pts = [(x, d) for x, d in zip(xs, ds, strict=True) if x in div]
    if pts:
        ax_diff.scatter(
            [p[0] for p in pts], [p[1] for p in pts], color="red", s=10, zorder=3, label="diverging"
        )
    biggest = max((abs(d) for d in ds if math.isfinite(d)), default=0.0)
    if 0 < biggest < 0.25 * s.tolerance:
        # Zoom in on a difference far inside the band, or the panel shows a flat line at zero.
        ax_diff.set_ylim(-1.4 * biggest, 1.4 * biggest)
        ax_diff.annotate(
            f"tolerance +/-{s.tolerance:.3g} is off this scale",
            (0.01, 0.04),
            xycoords="axes fraction",
            fontsize=8,
            color="green",
        )
    if c.drift.window and xs:
        lo = xs[-min(c.drift.window, len(xs))]
        ax_diff.axvspan(
            lo, xs[-1], color="grey", alpha=0.08, lw=0, label=f"drift window ({c.drift.window} steps)"
        )
        ax_diff.hlines(c.drift.last, lo, xs[-1], color="purple", lw=1.6, label=f"drift {c.drift.last:+.3g}")
    for ax, step, text in (
        (ax_loss, s.first_divergence, "loss diverges"),
        (ax_diff, s.first_divergence, ""),
        (ax_lr, c.lr.first_mismatch, "LR differs"),
        (ax_loss, c.data.first_mismatch, "data differs"),
    ):
        if step is not None:
            ax.axvline(step, color="red", ls=":", lw=0.9)
            if text:
                ax.annotate(
                    f"{text} @ {step}",
                    (step, 0.97),
                    xycoords=("data", "axes fraction"),
                    fontsize=8,
                    va="top",
                    ha="left",
                    color="red",
                )
    verdict = (
        f"agree (max |{c.b.label} - {c.a.label}| {_g(s.max_abs_diff, '.3g')}, tolerance {_g(s.tolerance, '.3g')})"
        if c.agree
        else "diverge: " + "; ".join(c.problems)
    )
    ax_loss.set_title(f"{c.b.label} vs {c.a.label}: {verdict}", fontsize=10, loc="left", wrap=True)
    ax_loss.set_ylabel("loss")
    ax_diff.set_ylabel("loss difference")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    for ax in (ax_loss, ax_diff, ax_lr):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as exc:
        raise RunInputError(f"cannot write plot {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
