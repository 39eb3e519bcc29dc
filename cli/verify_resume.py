"""``ckpt verify-resume RUN``: check that every resume in a run continued training exactly where it stopped."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ckpt.errors import CkptError
from ckpt.resume.checks import VerifyOptions
from ckpt.resume.report import render, to_json
from ckpt.resume.sources import SOURCES, load_run
from ckpt.resume.verify import verify_run

EPILOG = """\b
Examples:
  ckpt verify-resume runs/llama-8b                 # reads runs/llama-8b/ledger.jsonl
  ckpt verify-resume runs/llama-8b --plot resume.png
  ckpt verify-resume tb_logs/ --source tensorboard --no-deterministic
  ckpt verify-resume hf_out/ --json > verdict.json

\b
Exit codes: 0 continuous (warnings allowed), 1 discontinuity found, 2 bad input.
"""


@click.command("verify-resume", epilog=EPILOG)
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as JSON instead of tables.")
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path), help="Write loss/LR around each boundary."
)
@click.option(
    "--deterministic/--no-deterministic",
    default=None,
    help="Compare losses bit for bit / within calibrated noise (default: what the sessions logged).",
)
@click.option("--source", type=click.Choice(SOURCES), default="auto", show_default=True, help="Log format.")
@click.pass_context
def verify_resume(
    ctx: click.Context, run: Path, as_json: bool, plot: Path | None, deterministic: bool | None, source: str
) -> None:
    """Verify step, LR, loss, data and RNG continuity at every resume boundary of RUN."""
    try:
        result = verify_run(load_run(run, source), options=VerifyOptions(deterministic=deterministic))
        if plot is not None:
            from ckpt.resume.plot import plot_verification

            plot_verification(result, plot)
    except CkptError as exc:
        click.echo(f"error: {exc}", err=True)
        ctx.exit(exc.exit_code)
    if as_json:
        click.echo(json.dumps(to_json(result), indent=2))
    else:
        render(result)
    ctx.exit(result.exit_code)
