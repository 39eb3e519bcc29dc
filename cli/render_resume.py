"""Rich terminal tables for the resume commands: ``verify-resume``, ``compare`` and ``report`` (and ``demo``).

The words come from the library (:mod:`ckpt.resume.report`, :mod:`ckpt.resume.compare_report`, the
:class:`~ckpt.resume.cost.RunCost` numbers); this module only lays them out and colours them, so the library
never imports rich.  Text from the run (paths, notes, causes) is escaped: a ``[`` in a path is printed, not
read as markup.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from ckpt.resume.checks import Status
from ckpt.resume.compare import Comparison
from ckpt.resume.compare_report import VERDICTS, comparison_rows, side_line, table_title
from ckpt.resume.compare_report import verdict_line as comparison_verdict
from ckpt.resume.cost import RunCost
from ckpt.resume.model import Run
from ckpt.resume.report import CHECK_COLUMNS, NO_BOUNDARY, boundary_title, check_rows, run_line, verdict_line
from ckpt.resume.verify import Verification
from ckpt.words import count

from .common import human_bytes, out
from .table import Col, print_table


def _console() -> Console:
    """The commands' stdout console: soft-wrapped (no padding to a width), plain tables when piped."""
    return out


STATUS_STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim"}
KIND_STYLE = {"good": "green", "bad": "bold red", "notice": "yellow", "skipped": "dim", "": ""}
"""Colours of :data:`ckpt.resume.compare_report.VERDICTS` kinds."""


def _verdict(word: str, rest: str, good: bool) -> str:
    return f"[bold {'green' if good else 'red'}]{word}[/]{escape(rest)}"


def render_verification(result: Verification, console: Console | None = None) -> None:
    """``verify-resume``: the run, its notes, one table per boundary (check, verdict, cause, details) and a
    one-line verdict."""
    console = console or _console()
    path, what = run_line(result)
    console.print(f"[bold]{escape(path)}[/]{escape(what)}")
    for note in result.notes:
        console.print(f"[dim]note: {escape(note)}[/]")
    if not result.verdicts:
        console.print(NO_BOUNDARY)
    for v in result.verdicts:
        cols = [Col(c) for c in CHECK_COLUMNS[:-1]] + [Col(CHECK_COLUMNS[-1], fold=True)]
        rows = [
            [row.check, Text(row.status.value, style=STATUS_STYLE[row.status]), row.cause, row.details]
            for row in check_rows(v)
        ]
        print_table(console, cols, rows, title=boundary_title(v))
    word, rest = verdict_line(result)
    console.print(_verdict(word, rest, result.status is not Status.FAIL))


def render_comparison(c: Comparison, console: Console | None = None) -> None:
    """``compare``: each run in one line (and its notes), one table of what was compared, a one-line verdict."""
    con = console or _console()
    for side in (c.a, c.b):
        con.print(f"[bold]{escape(side.label)}[/]: {escape(side_line(side))}")
        for note in side.run.notes:
            con.print(f"[dim]  note: {escape(note)}[/]")
    rows = [
        [row.what, Text(row.verdict, style=KIND_STYLE[VERDICTS.get(row.verdict, "")]), row.details]
        for row in comparison_rows(c)
    ]
    print_table(con, [Col("what"), Col("verdict"), Col("details", fold=True)], rows, title=table_title(c))
    word, rest = comparison_verdict(c)
    con.print(_verdict(word, rest, c.agree))


def _seconds(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


#: the log formats that record how a process ended (the others cannot tell a clean exit from a kill)
_LOGS_EXITS = frozenset({"jsonl"})


def _exit_word(run: Run, ex: object) -> str:
    if ex is not None:
        return "clean" if getattr(ex, "clean", True) else "error"
    return "killed" if run.source in _LOGS_EXITS else "unknown"


def _saves_line(run: Run, cost: RunCost) -> str:
    """``saves: 4 (1.2 MiB), blocking 0.31s, background 0.02s``, with what the log did not record said so."""
    saves = [e for s in run.sessions for e in s.saves]
    known = [e.bytes for e in saves if e.bytes is not None]
    size = human_bytes(cost.save_bytes) if len(known) == len(saves) else (
        "size not logged" if not known else f"at least {human_bytes(cost.save_bytes)}"
    )  # fmt: skip
    if not any(e.blocking_seconds is not None or e.total_seconds is not None for e in saves) and saves:
        timing = "time not logged"
    else:
        timing = f"blocking {_seconds(cost.save_blocking_seconds)}, background {_seconds(cost.save_background_seconds)}"
    return f"saves: {cost.saves} ({size}), {timing}"


def render_cost(run: Run, cost: RunCost, console: Console | None = None) -> None:
    """``report``: one table of the run's sessions, one of what each failure cost (steps recomputed, downtime,
    restore, compile), and a line on checkpointing's own cost."""
    console = console or _console()
    rows = []
    for s in run.sessions:
        ex = s.exit
        rows.append(
            [
                s.id,
                str(len(s.steps)),
                str(s.steps[0].step) if s.steps else "-",
                str(s.steps[-1].step) if s.steps else "-",
                ", ".join(str(r.step) for r in s.restores) or "-",
                str(len(s.saves)),
                _exit_word(run, ex),
            ]
        )
    cols = [Col("session")] + [Col(c, "right") for c in ("steps", "first", "last", "restored", "saves")]
    print_table(
        console, [*cols, Col("exit")], rows, title=f"{run.path}: {count(len(run.sessions), 'session')}"
    )
    rows = [
        [
            str(f.boundary),
            str(f.crash_step),
            str(f.restored_step),
            str(f.steps_recomputed),
            _seconds(f.recompute_seconds),
            _seconds(f.downtime_seconds),
            _seconds(f.restore_seconds),
            f"{_seconds(f.compile_seconds)} ({f.compile_events})",
            f.tier or "-",
        ]
        for f in cost.failures
    ]
    heads = ("#", "crash step", "restored", "recomputed", "recompute time", "downtime", "restore", "compile")
    cols = [*(Col(h, "right") for h in heads), Col("tier")]
    print_table(console, cols, rows, title="Recovery cost per failure")
    if any(t.tier != "unknown" for t in cost.tiers):
        rows = [
            [
                t.tier,
                str(t.failures),
                _seconds(t.restore_seconds),
                _seconds(t.downtime_seconds),
                f"{t.steps_recomputed:g}",
            ]
            for t in cost.tiers
        ]
        heads = ("restores", "mean restore", "mean downtime", "mean recomputed")
        print_table(
            console, [Col("tier"), *(Col(h, "right") for h in heads)], rows, title="Recovery cost per tier"
        )
    console.print(
        f"{_saves_line(run, cost)}; compiles: {cost.compile_events} "
        f"({_seconds(cost.compile_seconds)}); median step {_seconds(cost.median_step_seconds)}"
    )
