"""``ckpt demo``: a real multi-rank run that saves asynchronously, crashes (SIGKILL), resumes and is compared.

It launches the tiny job in ``ckpt.cli.demo.train`` on N gloo ranks three times: an uninterrupted reference run, a
run killed in the middle of an async save, and its restart from the newest committed checkpoint; then it checks
that the resumed run's losses are bit-identical to the reference, runs ``verify-resume`` on the crashed run's
ledger and checkpoints (with a plot), and prints the recovery-cost report (``ckpt report``).

The ranks' own output (gloo prints "[Gloo] Rank N is connected to ..." on stdout, unconditionally, when a process
group connects; library warnings on stderr) goes to ``DIR/logs/<phase>.rank<N>.log``, shown only when a rank fails.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import click

from ckpt.errors import CkptError
from ckpt.words import count

from ..common import err, out

#: the demo job checkpoints every this many steps (``--save-every`` of ``train.py``)
SAVE_EVERY = 5
#: what a demo folder holds; ``--dir`` is emptied only when it holds nothing else
DEMO_ENTRIES = {"reference", "crashed", "logs"}


class DemoFailed(CkptError):
    """A step of the demo did not do what it shows (a rank failed, the round trip changed a tensor)."""

    exit_code = 1


def check_flags(workdir: str, ranks: int, steps: int, kill_at: int) -> None:
    """Refuse, before anything runs, flags with which the demo cannot show a crash and a resume."""
    first, last = SAVE_EVERY + 1, steps - 1
    if ranks < 1:
        raise CkptError(f"--ranks {ranks}: expected 1 or more processes")
    if steps < first + 1:
        raise CkptError(
            f"--steps {steps}: expected {first + 1} or more (the run checkpoints at step {SAVE_EVERY} and must "
            "crash after that, before its last step)"
        )
    if not first <= kill_at <= last:
        raise CkptError(
            f"--kill-at {kill_at}: expected a step from {first} to {last} (after the first checkpoint at step "
            f"{SAVE_EVERY}, before the last step {steps})"
        )
    if os.path.isfile(workdir):
        raise CkptError(f"--dir {workdir}: is a file; expected a folder for the demo's runs")
    if os.path.isdir(workdir):
        other = sorted(set(os.listdir(workdir)) - DEMO_ENTRIES)
        if other:
            raise CkptError(
                f"--dir {workdir}: holds {', '.join(other[:3])}{', ...' if len(other) > 3 else ''}, not a "
                "previous demo's runs; the demo empties its folder, so pick a new or empty one"
            )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(ranks: int, args: list[str], logs: str, phase: str) -> tuple[list[int], list[str]]:
    """Run the job on ``ranks`` gloo processes; their exit codes and log files (stdout and stderr together).

    If this process is interrupted (Ctrl-C), the ranks still running are killed before the interruption goes on.
    """
    port = str(_free_port())
    procs: list[subprocess.Popen] = []
    paths = [os.path.join(logs, f"{phase}.rank{r}.log") for r in range(ranks)]
    try:
        for r in range(ranks):
            env = dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS="1",
            )
            with open(paths[r], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "ckpt.cli.demo.train", *args],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        return [p.wait() for p in procs], paths
    except BaseException:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        raise


def _require_success(phase: str, codes: list[int], paths: list[str]) -> None:
    """Show the log of the first failed rank (its last lines) and stop, or return when every rank exited 0."""
    failed = [r for r, c in enumerate(codes) if c != 0]
    if not failed:
        return
    r = failed[0]
    with open(paths[r], errors="replace") as f:
        tail = f.read().splitlines()[-20:]
    err.print("\n".join(tail), markup=False, highlight=False)
    raise DemoFailed(f"{phase} run failed: rank {r} exited with {codes[r]} (its log: {paths[r]})")


def _log(run: str) -> tuple[list[dict], dict[int, dict]]:
    """Rank 0's ``losses.jsonl``: the session starts, and each step's record (the last session's, after a resume)."""
    with open(os.path.join(run, "losses.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("event") == "start"], {r["step"]: r for r in rows if "step" in r}


def _check_resume(ref: str, crash: str, steps: int, committed: list[int]) -> int:
    """Show and check that the restart restored the newest committed checkpoint and then repeated the reference
    run's losses and learning rates bit for bit; the restored step, or :class:`DemoFailed`."""
    from rich.table import Table

    starts, b = _log(crash)
    _, a = _log(ref)
    restored = starts[-1]["restored"]
    if not committed:
        raise DemoFailed(
            "no checkpoint had committed before the crash, so there was nothing to resume from: pass a later "
            f"--kill-at (checkpoints every {SAVE_EVERY} steps; an async save commits a step or more later)"
        )
    if restored != committed[-1]:
        raise DemoFailed(
            f"the restart restored {'nothing' if restored is None else f'step {restored}'}, expected the newest "
            f"committed checkpoint, step {committed[-1]}: the resume did not happen"
        )
    table = Table(title="loss after resume vs reference")
    for col in ("step", "reference", "resumed", "same bits"):
        table.add_column(col)
    differ = []
    for step in range(restored + 1, steps + 1):
        ra, rb = a.get(step), b.get(step)
        if ra is None or rb is None:
            raise DemoFailed(f"step {step} is missing from the {'reference' if ra is None else 'resumed'} run's log")
        same = ra["loss"] == rb["loss"] and ra["lr"] == rb["lr"]
        differ += [step] if not same else []
        loss_a, loss_b = float.fromhex(ra["loss"]), float.fromhex(rb["loss"])
        table.add_row(str(step), repr(loss_a), repr(loss_b), "[green]yes[/]" if same else "[red]no[/]")
    out.print(table)
    out.print(f"resumed from step {restored} (restore took {starts[-1]['restore_s']:.3f} s)")
    if differ:
        raise DemoFailed(
            f"{len(differ)} step{'s' if len(differ) != 1 else ''} after the resume differ from the reference "
            f"run (first: step {differ[0]})"
        )
    return restored


@click.command()
@click.option(
    "--dir",
    "workdir",
    default="demo_run",
    show_default=True,
    help="Where the demo writes its runs (emptied first; must be new, empty or a previous demo's).",
)
@click.option("--ranks", default=2, show_default=True, help="Number of gloo processes.")
@click.option("--steps", default=30, show_default=True, help=f"Training steps (more than {SAVE_EVERY + 1}).")
@click.option(
    "--kill-at",
    default=17,
    show_default=True,
    help=f"Step at which the crashing run SIGKILLs itself (after the first checkpoint at step {SAVE_EVERY}, "
    "before the last step).",
)
def demo(workdir: str, ranks: int, steps: int, kill_at: int) -> None:
    """Train on several ranks, crash mid async-save, resume, and prove the losses continue bit for bit."""
    from ckpt.restoring.discovery import list_checkpoints
    from ckpt.resume.cost import recovery_cost
    from ckpt.resume.sources import load_run

    check_flags(workdir, ranks, steps, kill_at)
    shutil.rmtree(workdir, ignore_errors=True)
    ref, crash = os.path.join(workdir, "reference"), os.path.join(workdir, "crashed")
    logs = os.path.join(workdir, "logs")
    for d in (ref, crash, logs):
        os.makedirs(d)
    # keep every checkpoint so verify-resume can read the restored one's manifest afterwards
    common = ["--steps", str(steps), "--save-every", str(SAVE_EVERY), "--keep-last", "100"]
    out.print(f"[bold]1/6[/] reference run: {count(ranks, 'rank')}, {count(steps, 'step')}")
    _require_success("reference", *_launch(ranks, ["--run", ref, *common], logs, "reference"))
    out.print(f"[bold]2/6[/] crashing run: SIGKILL at step {kill_at}, right after an async save started")
    codes, _ = _launch(ranks, ["--run", crash, "--kill-at", str(kill_at), *common], logs, "crash")
    out.print(f"    exit codes {codes} (-9 = killed)")
    committed = [i.step for i in list_checkpoints(os.path.join(crash, "checkpoints")) if i.status == "committed"]
    for info in list_checkpoints(os.path.join(crash, "checkpoints")):
        out.print(f"    step {info.step}: {info.status}")
    out.print("[bold]3/6[/] restart: restore_latest() and continue")
    _require_success("resumed", *_launch(ranks, ["--run", crash, *common], logs, "restart"))
    restored = _check_resume(ref, crash, steps, committed)
    out.print(
        f"[green]resume is bit-exact: restored step {restored}, and steps {restored + 1}-{steps} have the "
        "reference run's losses and learning rates bit for bit[/] (RNG and data position: step 4)"
    )
    verified = _verify(crash)
    _convert(crash)
    out.print("[bold]6/6[/] recovery cost ([cyan]ckpt report[/] on the crashed run)")
    from ..render_resume import render_cost

    run = load_run(crash)
    render_cost(run, recovery_cost(run))
    if verified.exit_code:
        sys.exit(verified.exit_code)


def _verify(run_dir: str):
    """Step 4: ``ckpt verify-resume`` on the crashed run, with its checkpoints' manifests and a plot."""
    from ckpt.resume.manifest_facts import ManifestFacts
    from ckpt.resume.sources import load_run
    from ckpt.resume.verify import verify_run

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
    from ..render_resume import render_verification

    render_verification(result, out)
    return result


def _convert(run_dir: str) -> None:
    """Step 5: take the newest checkpoint to the Neuron layout (NxD TP=2) and back with ``ckpt convert``.

    The round trip must give every model and optimizer tensor back bit for bit, with the training state
    (step, scheduler, RNG, data position) carried along, which is what a Trainium <-> GPU move relies on.
    """
    from ckpt.format.reader import CheckpointReader
    from ckpt.restoring.discovery import list_checkpoints

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
            raise DemoFailed(f"ckpt convert failed: {done.stderr.strip()}")
    a, n, b = CheckpointReader(src), CheckpointReader(neuron), CheckpointReader(back)
    qkv = next(name for name in n.manifest.tensors if "qkv_proj" in name or "q_proj" in name)
    out.print(
        f"    neuron layout: tp={n.manifest.layout.tp}, {count(len(n.manifest.tensors), 'tensor')} "
        f"(e.g. {qkv} {list(n.manifest.tensors[qkv].shape)}, partition {n.manifest.tensors[qkv].partition})"
    )
    out.print(f"    [cyan]ckpt convert {neuron} {back} --to cuda[/]")
    same = [
        name for name in a.manifest.tensors if name in b.manifest.tensors and a.read(name).equal(b.read(name))
    ]
    if len(same) != len(a.manifest.tensors) or b.manifest.scheduler != a.manifest.scheduler:
        raise DemoFailed(f"round trip changed {count(len(a.manifest.tensors) - len(same), 'tensor')}")
    out.print(
        f"    round trip: all {len(same)} model and optimizer tensors bit-identical; step {b.manifest.step}, "
        "scheduler, RNG and data position carried"
    )
