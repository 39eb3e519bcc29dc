"""``ckpt report RUN``: sessions of a run and what each failure cost (steps lost, downtime, restore, compile)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

from ckpt.resume.sources import SOURCES

if TYPE_CHECKING:
    from ckpt.resume.cost import RunCost
    from ckpt.resume.model import Run

from .common import human_bytes

EPILOG = """\b
Examples:
  ckpt report runs/llama-8b
  ckpt report runs/llama-8b --json

\b
Exit codes: 0 report printed, 2 bad input.
"""


def _fmt(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def _render(run: Run, cost: RunCost) -> None:
    console = Console()
    sessions = Table(title=f"{run.path}: {len(run.sessions)} sessions", title_justify="left")
    for col in ("session", "steps", "first", "last", "restored", "saves", "exit"):
        sessions.add_column(col)
    for s in run.sessions:
        restored = ", ".join(str(r.step) for r in s.restores) or "-"
        ex = s.exit
        sessions.add_row(
            s.id,
            str(len(s.steps)),
            str(s.steps[0].step) if s.steps else "-",
            str(s.steps[-1].step) if s.steps else "-",
            restored,
            str(len(s.saves)),
            "killed" if ex is None else ("clean" if ex.clean else "error"),
        )
    console.print(sessions)
    failures = Table(title="Recovery cost per failure", title_justify="left")
    for col in (
        "#",
        "crash step",
        "restored",
        "recomputed",
        "recompute time",
        "downtime",
        "restore",
        "compile",
    ):
        failures.add_column(col, justify="right")
    for f in cost.failures:
        failures.add_row(
            str(f.boundary),
            str(f.crash_step),
            str(f.restored_step),
            str(f.steps_recomputed),
            _fmt(f.recompute_seconds),
            _fmt(f.downtime_seconds),
            _fmt(f.restore_seconds),
            f"{_fmt(f.compile_seconds)} ({f.compile_events})",
        )
    console.print(failures)
    console.print(
        f"saves: {cost.saves} ({human_bytes(cost.save_bytes)}), blocking {_fmt(cost.save_blocking_seconds)}, background "
        f"{_fmt(cost.save_background_seconds)}; compiles: {cost.compile_events} ({_fmt(cost.compile_seconds)}); "
        f"median step {_fmt(cost.median_step_seconds)}"
    )


@click.command("report", epilog=EPILOG)
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the cost report as JSON.")
@click.option("--source", type=click.Choice(SOURCES), default="auto", show_default=True, help="Log format.")
@click.pass_context
def report(ctx: click.Context, run: Path, as_json: bool, source: str) -> None:
    """Summarise the sessions of RUN and the cost of each failure and of checkpointing."""
    from ckpt.resume.cost import recovery_cost
    from ckpt.resume.sources import load_run

    loaded = load_run(run, source)
    cost = recovery_cost(loaded)
    if as_json:
        click.echo(
            json.dumps({"run": loaded.path, "sessions": len(loaded.sessions), **cost.to_json()}, indent=2)
        )
    else:
        _render(loaded, cost)
