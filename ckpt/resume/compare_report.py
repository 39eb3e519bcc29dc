"""The words of a :class:`~ckpt.resume.compare.Comparison`: table rows, run lines and the verdict, as plain text.

Styling (colours, table borders) is the CLI's job (``cli/render_resume.py``); this module decides what is
said, so every front end (the terminal table, a piped log, an assertion message) says the same thing.
Verdict words in :attr:`Row.verdict` are one of ``VERDICTS``; a front end colours them by kind.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ckpt.resume.compare import Comparison, ExactCheck, RunSide
from ckpt.resume.environment import env_summary
from ckpt.words import count

VERDICTS = {
    "equal": "good",
    "agree": "good",
    "none": "good",
    "same": "good",
    "different": "bad",
    "diverge": "bad",
    "significant": "bad",
    "differs": "notice",
    "skip": "skipped",
    "": "",
}
"""Each verdict word of the table and its kind: ``good``, ``bad``, ``notice`` (differs, does not fail) or
``skipped``."""


class Row(NamedTuple):
    """One row of the comparison table."""

    what: str
    verdict: str
    details: str


def fmt(x: float | None, spec: str = ".4g") -> str:
    """A number for people: ``n/a`` for a missing or non-finite value."""
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def side_line(side: RunSide) -> str:
    """What one run is, after its label: ``path (source, N sessions, M effective steps, values P)``."""
    r = side.run
    return (
        f"{r.path} ({r.source}, {count(len(r.sessions), 'session')}, "
        f"{len(side.curve)} effective steps, values {r.precision})"
    )


def table_title(c: Comparison) -> str:
    return f"{c.b.label} vs {c.a.label} (differences are {c.b.label} - {c.a.label})"


def verdict_line(c: Comparison) -> tuple[str, str]:
    """(word, the rest): ``("AGREE", " over 80 common steps")`` or ``("DIVERGE", ": LR differs ...")``."""
    if c.agree:
        return "AGREE", f" over {len(c.steps)} common steps"
    return "DIVERGE", f": {'; '.join(c.problems)}"


def _exact_row(
    what: str, check: ExactCheck, unlogged: str, equal: str, *, prefix: str = "", values: str = ""
) -> Row:
    """The row of a series compared exactly (LR, data order): skipped, where it first differs, or equal."""
    if check.status == "not logged":
        return Row(what, "skip", unlogged)
    if check.differs:
        return Row(
            what,
            "different",
            f"{prefix}first differs at step {check.first_mismatch}{values} "
            f"({check.mismatched}/{check.compared} steps differ)",
        )
    return Row(what, "equal", equal)


def comparison_rows(c: Comparison) -> list[Row]:
    """One row per aspect compared, with the numbers a person needs to trust the verdict."""
    a, b, s = c.a, c.b, c.loss
    rows: list[Row] = []
    span = f"{c.steps[0]}..{c.steps[-1]}" if c.steps else "none"
    extra = f"; only in {a.label}: {c.only_a}, only in {b.label}: {c.only_b}" if c.only_a or c.only_b else ""
    rows.append(
        Row("steps", "", f"{len(c.steps)} common steps ({span}), {s.compared} with both losses{extra}")
    )
    rows.append(
        _exact_row(
            "learning rate",
            c.lr,
            "not logged by both runs",
            f"{c.lr.compared} steps equal bit for bit",
            values=f": {a.label} {c.lr.a!r} vs {b.label} {c.lr.b!r}",
        )
    )
    how = {
        "calibrated": f"{fmt(s.k, 'g')} x noise floor",
        "absolute": "--tolerance",
        "relative": "--rtol x |loss A|",
    }[s.tolerance_mode]
    rows.append(
        Row(
            "noise floor",
            "",
            f"{fmt(s.noise_floor)} (robust sigma of step-to-step changes: {a.label} {fmt(a.noise_floor)}, "
            f"{b.label} {fmt(b.noise_floor)}); tolerance {fmt(s.tolerance)} ({how})",
        )
    )
    if s.bitwise_equal:
        loss_verdict, detail = "equal", f"{s.compared} losses equal bit for bit"
    else:
        loss_verdict = "diverge" if s.diverging else "agree"
        detail = (
            f"|{b.label}-{a.label}| mean {fmt(s.mean_abs_diff)}, median {fmt(s.median_abs_diff)}, max {fmt(s.max_abs_diff)} "
            f"at step {s.max_abs_diff_step}; relative mean {fmt(s.mean_rel_diff, '.2e')}, "
            f"max {fmt(s.max_rel_diff, '.2e')}"
        )
        if s.diverging:
            detail += f"; {len(s.diverging)} steps beyond tolerance, first at step {s.first_divergence}"
    rows.append(Row("loss", loss_verdict, detail))
    d = c.drift
    rows.append(
        Row(
            "drift",
            "significant" if d.significant else "none",
            f"median {b.label}-{a.label} {fmt(d.last, '+.4g')} over the last {d.window} steps "
            f"({fmt(d.first, '+.4g')} over the first); threshold {fmt(d.threshold)}",
        )
    )
    rows.append(
        _exact_row(
            "data order",
            c.data,
            "data digests not logged by both runs",
            f"same batches in the same order at {c.data.compared} steps",
            prefix=f"{c.data.status}: ",
        )
    )
    if c.tokenizer == "equal":
        tok_detail = f"both {a.tokenizer_id}"
    elif c.tokenizer == "different":
        tok_detail = f"{a.label}: {a.tokenizer_id} / {b.label}: {b.tokenizer_id}"
    else:
        tok_detail = f"not logged by both runs ({a.label}: {a.tokenizer_id}, {b.label}: {b.tokenizer_id})"
    rows.append(Row("tokenizer", "skip" if c.tokenizer == "not logged" else c.tokenizer, tok_detail))
    env = f"{a.label}: {env_summary(a.env)} / {b.label}: {env_summary(b.env)}"
    if c.env_differences:
        env += "; differs: " + ", ".join(f"{k} {va} vs {vb}" for k, va, vb in c.env_differences)
    rows.append(Row("environment", "differs" if c.env_differences else "same", env))
    return rows
