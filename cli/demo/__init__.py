"""``ckpt demo``: a real multi-rank run that saves asynchronously, crashes (SIGKILL), resumes and is compared.

It launches the tiny job in ``ckpt.cli.demo.train`` on N gloo ranks three times: an uninterrupted reference run, a
run killed in the middle of an async save, and its restart from the newest committed checkpoint; then it checks
that the resumed run's losses are bit-identical to the reference, runs ``verify-resume`` on the crashed run's
ledger and checkpoints (with a plot), and prints the recovery-cost report (``ckpt report``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import click
from rich.table import Table

from ckpt.discovery import list_checkpoints
from ckpt.resume.cost import recovery_cost
from ckpt.resume.manifest_facts import ManifestFacts
from ckpt.resume.report import render
from ckpt.resume.sources import load_run
from ckpt.resume.verify import verify_run

from ..common import out
from ..report import _render as render_cost


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(ranks: int, args: list[str]) -> list[int]:
    port = str(_free_port())
    procs = []
    for r in range(ranks):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        procs.append(subprocess.Popen([sys.executable, "-m", "ckpt.cli.demo.train", *args], env=env))
    return [p.wait() for p in procs]


def _losses(run: str) -> dict[int, str]:
    with open(os.path.join(run, "losses.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "step" in r}


@click.command()
@click.option(
    "--dir", "workdir", default="demo_run", show_default=True, help="Where the demo writes its runs."
)
@click.option("--ranks", default=2, show_default=True, help="Number of gloo processes.")
@click.option("--steps", default=30, show_default=True)
@click.option(
    "--kill-at", default=17, show_default=True, help="Step at which the crashing run SIGKILLs itself."
)
def demo(workdir: str, ranks: int, steps: int, kill_at: int) -> None:
    """Train on several ranks, crash mid async-save, resume, and prove the losses continue bit for bit."""
    shutil.rmtree(workdir, ignore_errors=True)
    ref, crash = os.path.join(workdir, "reference"), os.path.join(workdir, "crashed")
    os.makedirs(ref)
    os.makedirs(crash)
    # keep every checkpoint so verify-resume can read the restored one's manifest afterwards
    common = ["--steps", str(steps), "--save-every", "5", "--keep-last", "100"]
    out.print(f"[bold]1/6[/] reference run: {ranks} ranks, {steps} steps")
    if any(_launch(ranks, ["--run", ref, *common])):
        raise click.ClickException("reference run failed")
    out.print(f"[bold]2/6[/] crashing run: SIGKILL at step {kill_at}, right after an async save started")
    codes = _launch(ranks, ["--run", crash, "--kill-at", str(kill_at), *common])
    out.print(f"    exit codes {codes} (-9 = killed)")
    for info in list_checkpoints(os.path.join(crash, "checkpoints")):
        out.print(f"    step {info.step}: {info.status}")
    out.print("[bold]3/6[/] restart: restore_latest() and continue")
    if any(_launch(ranks, ["--run", crash, *common])):
        raise click.ClickException("resumed run failed")
    a, b = _losses(ref), _losses(crash)
    table = Table(title="loss after resume vs reference")
    for col in ("step", "reference", "resumed", "same bits"):
        table.add_column(col)
    with open(os.path.join(crash, "losses.jsonl")) as f:
        starts = [json.loads(line) for line in f if '"event"' in line]
    resumed_from = starts[-1]["restored"]
    mismatches = 0
    for step in range(resumed_from + 1, steps + 1):
        same = a.get(step) == b.get(step)
        mismatches += not same
        table.add_row(
            str(step),
            repr(float.fromhex(a[step])),
            repr(float.fromhex(b[step])),
            "[green]yes[/]" if same else "[red]no[/]",
        )
    out.print(table)
    out.print(f"resumed from step {resumed_from} (restore took {starts[-1]['restore_s']:.3f} s)")
    if mismatches:
        out.print(f"[red]{mismatches} step(s) differ after resume[/]")
        sys.exit(1)
    out.print("[green]resume is bit-exact: same losses, learning rates, RNG and data position[/]")
    verified = _verify(crash)
    _convert(crash)
    out.print("[bold]6/6[/] recovery cost ([cyan]ckpt report[/] on the crashed run)")
    run = load_run(crash)
    render_cost(run, recovery_cost(run))
    if verified.exit_code:
        sys.exit(verified.exit_code)


def _verify(run_dir: str):
    """Step 4: ``ckpt verify-resume`` on the crashed run, with its checkpoints' manifests and a plot."""
    png = os.path.join(run_dir, "resume.png")
    out.print(f"[bold]4/6[/] [cyan]ckpt verify-resume {run_dir} --plot {png}[/]")
    facts = ManifestFacts(os.path.join(run_dir, "checkpoints"))
    result = verify_run(load_run(run_dir), facts=facts)
    result.notes.extend(facts.notes)
    try:
        from ckpt.resume.plot import plot_verification

        plot_verification(result, png)
        out.print(f"    plot: {png}")
    except ImportError:  # pragma: no cover - matplotlib is optional; the verdict does not need it
        out.print("    (no plot: pip install 'ckpt[plot]')")
    render(result, out)
    return result


def _convert(run_dir: str) -> None:
    """Step 5: take the newest checkpoint to the Neuron layout (NxD TP=2) and back with ``ckpt convert``.

    The round trip must give every model and optimizer tensor back bit for bit, with the training state
    (step, scheduler, RNG, data position) carried along, which is what a Trainium <-> GPU move relies on.
    """
    from ckpt.discovery import list_checkpoints
    from ckpt.reader import CheckpointReader

    committed = [i for i in list_checkpoints(os.path.join(run_dir, "checkpoints")) if i.status == "committed"]
    src = os.path.join(run_dir, "checkpoints", committed[-1].name)
    neuron, back = os.path.join(run_dir, "converted-neuron-tp2"), os.path.join(run_dir, "converted-back-cuda")
    config = os.path.join(run_dir, "config.json")
    out.print(f"[bold]5/6[/] [cyan]ckpt convert {src} {neuron} --to neuron --tp 2 --config {config}[/]")
    for args in (
        [src, neuron, "--to", "neuron", "--tp", "2", "--config", config],
        [neuron, back, "--to", "cuda"],
    ):
        shutil.rmtree(args[1], ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-m", "ckpt", "convert", *args], capture_output=True, text=True
        )
        if done.returncode:
            raise click.ClickException(f"ckpt convert failed: {done.stderr.strip()}")
    a, n, b = CheckpointReader(src), CheckpointReader(neuron), CheckpointReader(back)
    qkv = next(name for name in n.manifest.tensors if "qkv_proj" in name or "q_proj" in name)
    out.print(
        f"    neuron layout: tp={n.manifest.layout.tp}, {len(n.manifest.tensors)} tensors "
        f"(e.g. {qkv} {list(n.manifest.tensors[qkv].shape)}, partition {n.manifest.tensors[qkv].partition})"
    )
    out.print(f"    [cyan]ckpt convert {neuron} {back} --to cuda[/]")
    same = [
        name for name in a.manifest.tensors if name in b.manifest.tensors and a.read(name).equal(b.read(name))
    ]
    if len(same) != len(a.manifest.tensors) or b.manifest.scheduler != a.manifest.scheduler:
        raise click.ClickException(f"round trip changed {len(a.manifest.tensors) - len(same)} tensor(s)")
    out.print(
        f"    round trip: all {len(same)} model and optimizer tensors bit-identical; step {b.manifest.step}, "
        "scheduler, RNG and data position carried"
    )
