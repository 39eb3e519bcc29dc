"""``ckpt report RUN``: sessions of a run and what each failure cost (steps lost, downtime, restore, compile)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ckpt.resume.sources import SOURCES

EPILOG = """\b
Examples:
  ckpt report runs/llama-8b
  ckpt report runs/llama-8b --json

\b
Exit codes: 0 report printed, 2 bad input.
"""


@click.command("report", epilog=EPILOG)
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the cost report as JSON.")
@click.option("--source", type=click.Choice(SOURCES), default="auto", show_default=True, help="Log format.")
@click.pass_context
def report(ctx: click.Context, run: Path, as_json: bool, source: str) -> None:
    """Summarise the sessions of RUN and the cost of each failure and of checkpointing."""
    from ckpt.resume.cost import recovery_cost
    from ckpt.resume.sources import load_run

    from .render_resume import render_cost

    loaded = load_run(run, source)
    cost = recovery_cost(loaded)
    if as_json:
        click.echo(
            json.dumps({"run": loaded.path, "sessions": len(loaded.sessions), **cost.to_json()}, indent=2)
        )
    else:
        render_cost(loaded, cost)
