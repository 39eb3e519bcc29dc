"""``ckpt verify-resume RUN``: check that every resume in a run continued training exactly where it stopped."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ckpt.resume.sources import SOURCES

if TYPE_CHECKING:
    from ckpt.resume.verify import Verification

EPILOG = """\b
Examples:
  ckpt verify-resume runs/llama-8b                 # reads runs/llama-8b/ledger.jsonl (+ checkpoints/)
  ckpt verify-resume runs/llama-8b --plot resume.png
  ckpt verify-resume tb_logs/ --source tensorboard --no-deterministic
  ckpt verify-resume hf_out/ --json > verdict.json
  ckpt verify-resume runs/x --replay 'python train.py --resume {checkpoint} --max-steps {stop} --out {run}'

\b
Replay placeholders (shell-quoted): {checkpoint} checkpoint path, {step} its step N,
{steps} K steps to train, {stop} N+K, {run} scratch run directory, {ledger} {run}/ledger.jsonl.

\b
Exit codes: 0 continuous (warnings allowed), 1 discontinuity found, 2 bad input.
"""


def _facts(run: Path, checkpoints: str | None):
    """The facts provider for RUN's checkpoints: ckpt manifests (``RUN/checkpoints`` when present), the
    ``checkpoint-N`` folders of an HF Trainer output dir, or NxD tags (``--checkpoints``: model digests only); None
    when there are none."""
    from ckpt.resume.hf_facts import TrainerCheckpointFacts, is_trainer_output
    from ckpt.resume.ledger import checkpoints_dir
    from ckpt.resume.manifest_facts import ManifestFacts
    from ckpt.resume.nxd_facts import NxdTagCheckpoints, holds_tags

    if checkpoints:
        if is_trainer_output(checkpoints):
            return TrainerCheckpointFacts(checkpoints)
        if "://" not in checkpoints and holds_tags(checkpoints):
            return NxdTagCheckpoints(checkpoints)
        return ManifestFacts(checkpoints)
    root = run if run.is_dir() else run.parent
    if checkpoints_dir(root).is_dir():
        return ManifestFacts(os.fspath(checkpoints_dir(root)))
    if is_trainer_output(root):
        return TrainerCheckpointFacts(root)
    return None


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
@click.option(
    "--checkpoints",
    help="Checkpoint root whose manifests give the restored counters, or a folder of NxD tags (model digests "
    "only) (default: RUN/checkpoints if present).",
)
@click.option("--replay", "replay_cmd", help="Re-run this training command from a checkpoint and compare.")
@click.option("--from-step", type=int, help="Replay from this checkpoint step (default: newest usable).")
@click.option("--replay-steps", type=int, help="Steps to replay (default: up to 10 logged after it).")
@click.option(
    "--scratch", type=click.Path(file_okay=False, path_type=Path), help="Replay run directory (kept)."
)
@click.pass_context
def verify_resume(
    ctx: click.Context,
    run: Path,
    as_json: bool,
    plot: Path | None,
    deterministic: bool | None,
    source: str,
    checkpoints: str | None,
    replay_cmd: str | None,
    from_step: int | None,
    replay_steps: int | None,
    scratch: Path | None,
) -> None:
    """Verify step, LR, loss, data and RNG continuity at every resume boundary of RUN.

    With --replay, re-run training from one checkpoint instead and compare it step by step with RUN's log.
    """
    from ckpt.resume.checks import VerifyOptions
    from ckpt.resume.report import to_json
    from ckpt.resume.sources import load_run
    from ckpt.resume.verify import verify_run

    from .render_resume import render_verification

    if plot is not None:
        from ckpt.resume.plot import check_plot_path

        check_plot_path(plot)
    if checkpoints is not None and not os.path.isdir(checkpoints) and "://" not in checkpoints:
        from ckpt.resume.errors import RunInputError

        raise RunInputError(f"--checkpoints {checkpoints}: no such directory (expected a checkpoint root)")
    options = VerifyOptions(deterministic=deterministic)
    rows = None
    if replay_cmd is not None:
        from ckpt.resume.continuity import step_rows
        from ckpt.resume.replay import replay_command

        outcome = replay_command(
            run,
            replay_cmd,
            from_step=from_step,
            steps=replay_steps,
            checkpoints=checkpoints,
            scratch=scratch,
            options=options,
            source=source,
        )
        result: Verification = outcome.verification
        rows = step_rows(result.verdicts[0])
    else:
        if from_step is not None or replay_steps is not None or scratch is not None:
            raise click.UsageError("--from-step, --replay-steps and --scratch need --replay")
        facts = _facts(run, checkpoints)
        result = verify_run(load_run(run, source), options=options, facts=facts)
        if facts is not None:
            result.notes.extend(facts.notes)
    if plot is not None:
        from ckpt.resume.plot import plot_verification

        plot_verification(result, plot)
    if as_json:
        doc = to_json(result)
        if rows is not None:
            doc["replay"] = {
                "command": outcome.command,
                "scratch": str(outcome.scratch),
                "from_step": outcome.from_step,
                "steps": outcome.steps,
                "rows": rows,
            }
        click.echo(json.dumps(doc, indent=2))
    else:
        if rows is not None:
            from ckpt.resume.continuity import render_rows

            click.echo(f"replayed {outcome.steps} steps from step {outcome.from_step}: {outcome.command}")
            click.echo(render_rows(rows), nl=False)
        render_verification(result)
    ctx.exit(result.exit_code)
