"""``ckpt compare RUN_A RUN_B``: do two runs of the same job (e.g. Trainium vs GPU) train the same curve?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ckpt.resume.compare import DEFAULT_K, DEFAULT_WINDOW
from ckpt.resume.sources import SOURCES

if TYPE_CHECKING:
    from ckpt.resume.compare import Comparison

from .common import out

EPILOG = """\b
Examples:
  ckpt compare runs/small-gpu runs/small-trn                  # two ledgers; A is the reference
  ckpt compare runs/small-gpu runs/small-trn --plot cmp.png --label-a gpu --label-b trn
  ckpt compare runs/gpu tb_logs/ --source-b tensorboard --rtol 0.01
  ckpt compare runs/a runs/b --json > comparison.json

\b
Default tolerance: k (--k, 5) times the noise floor sqrt((sA^2 + sB^2) / 2), where s is each run's robust
(median/MAD) sigma of step-to-step loss changes, plus the rounding of the logged values.

\b
Exit codes: 0 the losses agree within tolerance and LR, data order and tokenizer are equal,
1 the losses diverge or drift apart, or LR / data order / tokenizer differ, 2 bad input.
"""


@click.command("compare", epilog=EPILOG)
@click.argument("run_a", type=click.Path(path_type=Path))
@click.argument("run_b", type=click.Path(path_type=Path))
@click.option(
    "--source-a", type=click.Choice(SOURCES), default="auto", show_default=True, help="Format of RUN_A."
)
@click.option(
    "--source-b", type=click.Choice(SOURCES), default="auto", show_default=True, help="Format of RUN_B."
)
@click.option(
    "--tolerance", type=float, help="Absolute per-step loss tolerance (replaces the calibrated one)."
)
@click.option("--rtol", type=float, help="Relative per-step loss tolerance, times |loss A|.")
@click.option(
    "--k", "k", type=float, default=DEFAULT_K, show_default=True, help="Calibrated tolerance in noise floors."
)
@click.option(
    "--window",
    type=int,
    default=DEFAULT_WINDOW,
    show_default=True,
    help="Trailing steps of the drift estimate.",
)
@click.option("--label-a", default="A", show_default=True, help="Name of RUN_A in the output (e.g. gpu).")
@click.option("--label-b", default="B", show_default=True, help="Name of RUN_B in the output (e.g. trn).")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON instead of a table.")
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path), help="Write loss, difference and LR."
)
@click.pass_context
def compare(
    ctx: click.Context,
    run_a: Path,
    run_b: Path,
    source_a: str,
    source_b: str,
    tolerance: float | None,
    rtol: float | None,
    k: float,
    window: int,
    label_a: str,
    label_b: str,
    as_json: bool,
    plot: Path | None,
) -> None:
    """Compare the effective loss/LR curves of RUN_A (reference) and RUN_B step by step.

    Reports LR equality, loss differences against a calibrated noise floor, divergent steps, drift, data order,
    tokenizer and environment differences.
    """
    from ckpt.resume.compare import compare_runs
    from ckpt.resume.sources import load_run

    from .render_resume import render_comparison

    if plot is not None:
        from ckpt.resume.plot import check_plot_path

        check_plot_path(plot)
    result: Comparison = compare_runs(
        load_run(run_a, source_a),
        load_run(run_b, source_b),
        tolerance=tolerance,
        rtol=rtol,
        k=k,
        window=window,
        labels=(label_a, label_b),
    )
    if plot is not None:
        from ckpt.resume.compare_plot import plot_comparison

        plot_comparison(result, plot)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        render_comparison(result, out)
    ctx.exit(result.exit_code)
