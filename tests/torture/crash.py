"""Crash-consistency harness: SIGKILL a checkpointing training process at random moments, restart, check.

One *trial* = start :mod:`torture.trainer` on the same root (it calls ``restore_latest``), wait until it reports
``ready``, let it train and save asynchronously for a random (seeded) delay, then SIGKILL it — often while its
background writer is inside a save or while retention deletes old steps. Between runs the harness, independently
of the trainer, lists the root, fully verifies every committed checkpoint (sizes and checksums of every shard) and
records the newest one. The next run must then:

* restore exactly that step (never an older one while a newer committed one is intact, never an uncommitted one);
* restore exactly the state that was saved for that step (digest logged by the trainer before ``save``);
* continue training with bit-identical losses for steps that an earlier run had already trained.

A committed checkpoint that fails verification, a restore of anything else, or a digest mismatch counts as a
*corrupt restore*; the harness reports them instead of stopping so that one run yields complete figures.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckpt.format.integrity import verify_checkpoint
from ckpt.format.reader import CheckpointReader
from ckpt.restoring.discovery import list_checkpoints
from ckpt.storage import open_storage
from ckpt.storage.s3 import S3Storage

TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer.py")


@dataclass
class CrashReport:
    """What a series of trials found. ``corrupt_restores`` and ``divergent_losses`` must be 0."""

    storage: str
    trials: int = 0
    kills: int = 0
    kills_during_save: int = 0
    restores: int = 0
    restores_from_scratch: int = 0
    corrupt_restores: int = 0
    divergent_losses: int = 0
    lost_steps: list[int] = field(default_factory=list)
    committed_checked: int = 0
    final_step: int = 0
    open_multipart_uploads: int | None = None
    leftover_uncommitted: int = 0
    lazy_saves: int = 0  # saves whose optimizer state was copied in the background (lazy staging)
    writers_left: int = 0  # writer processes (--process-writer) still running after their trainer was killed
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        lost = self.lost_steps
        d["lost_steps"] = {
            "total": sum(lost),
            "mean": round(sum(lost) / len(lost), 2) if lost else 0,
            "max": max(lost, default=0),
        }
        d["problems"] = self.problems[:20]
        return d


def read_events(path: str) -> list[dict[str, Any]]:
    """All complete events in the log (a line cut by a kill cannot occur: one write per line)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def newest_verified(root: str, storage_options: dict[str, Any] | None, report: CrashReport) -> int | None:
    """The newest committed step, after fully verifying every committed checkpoint (a failure is recorded)."""
    storage = open_storage(root, storage_options)
    newest = None
    for info in list_checkpoints(storage):
        if info.status == "damaged":
            report.problems.append(f"step {info.step} damaged after a kill: {info.error}")
            report.corrupt_restores += 1
        if info.status != "committed":
            continue
        report.committed_checked += 1
        problems = verify_checkpoint(CheckpointReader(storage.child(info.name)))
        if problems:
            report.corrupt_restores += 1
            report.problems.append(f"committed step {info.step} fails verification: {problems[0]}")
            continue
        newest = info.step
    return newest


def _wait_ready(log: str, pid: int, proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in read_events(log):
            if ev["ev"] == "ready" and ev["pid"] == pid:
                return ev
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"trainer exited with {proc.returncode} before ready: {err[-2000:]}")
        time.sleep(0.02)
    proc.kill()
    raise TimeoutError(f"trainer not ready after {timeout}s")


def exited(pid: int, timeout: float = 10.0) -> bool:
    """Process ``pid`` is gone (or a zombie) within ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.05)


def run_trials(
    root: str,
    workdir: str,
    trials: int,
    *,
    seed: int = 0,
    endpoint: str | None = None,
    max_delay: float = 1.5,
    every: int = 1,
    keep_last: int = 2,
    ready_timeout: float = 180.0,
    progress: bool = False,
    process_writer: bool = False,
    local_dir: str | None = None,
    persist_every: int | None = None,
    local_memory: bool = False,
) -> CrashReport:
    """Run ``trials`` kill/restart cycles on ``root`` and one final restart; return the figures.

    ``local_dir``: the trainer saves every step to that node-local tier too (ckpt.tiers), and to ``root`` every
    ``persist_every`` steps; the step a restart must restore is then the newest verified one in either.
    ``local_memory``: that tier is the host-memory tier (``local_dir`` on /dev/shm)."""
    rng = random.Random(seed)
    options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else None
    report = CrashReport("s3" if root.startswith("s3://") else "local")
    log = os.path.join(workdir, "events.jsonl")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    started = time.monotonic()

    def newest() -> int | None:
        steps = [newest_verified(root, options, report)]
        if local_dir is not None:  # the run's local steps live in <local_dir>/run-<id>/ (one run here)
            steps += [newest_verified(str(d), None, report) for d in sorted(Path(local_dir).glob("run-*"))]
        known = [s for s in steps if s is not None]
        return max(known) if known else None

    expected = newest()
    last_trained: int | None = None
    losses: dict[int, str] = {}
    for trial in range(trials + 1):
        final = trial == trials
        cmd = [sys.executable, TRAINER, "--root", root, "--log", log, "--every", str(every)]
        cmd += ["--keep-last", str(keep_last)] + (["--endpoint", endpoint] if endpoint else [])
        cmd += ["--process-writer"] if process_writer else []
        if local_dir is not None:
            cmd += (
                ["--local-dir", local_dir]
                + (["--persist-every", str(persist_every)] if persist_every else [])
                + (["--local-memory"] if local_memory else [])
            )
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        ready = _wait_ready(log, proc.pid, proc, ready_timeout)
        report.restores += 1
        restored = ready["restored"]
        if restored is None:
            report.restores_from_scratch += 1
        if restored != expected:
            report.corrupt_restores += 1
            report.problems.append(f"trial {trial}: restored step {restored}, newest committed is {expected}")
        elif restored is not None:
            saved = [e["digest"] for e in read_events(log) if e["ev"] == "save" and e["step"] == restored]
            if not saved or ready["digest"] != saved[-1]:
                report.corrupt_restores += 1
                report.problems.append(
                    f"trial {trial}: step {restored} restored a state that was never saved"
                )
        if last_trained is not None:
            report.lost_steps.append(last_trained - (restored or 0))
        if final:
            time.sleep(0.5)  # let it train a little: continuation is checked on these steps too
        else:
            time.sleep(rng.uniform(0.0, max_delay))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stderr:
            proc.stderr.close()
        events = [e for e in read_events(log) if e["pid"] == proc.pid]
        report.trials += 0 if final else 1
        report.kills += 1
        saves = {e["step"] for e in events if e["ev"] == "save"}
        report.lazy_saves += sum(1 for e in events if e["ev"] == "staged" and e["lazy_bytes"] > 0)
        writers = {e["writer"] for e in events if e["ev"] == "staged" and e.get("writer")}
        left = [w for w in writers if not exited(w)]
        if left:
            report.writers_left += len(left)
            report.problems.append(f"trial {trial}: writer process(es) {left} outlived the killed trainer")
        committed = {e["step"] for e in events if e["ev"] == "committed"}
        if saves - committed:
            report.kills_during_save += 1
        steps = [e for e in events if e["ev"] == "step"]
        for e in steps:
            if e["step"] in losses and losses[e["step"]] != e["loss"]:
                report.divergent_losses += 1
                report.problems.append(f"trial {trial}: step {e['step']} loss differs from the earlier run")
            losses[e["step"]] = e["loss"]
        last_trained = steps[-1]["step"] if steps else (restored or 0)
        report.final_step = max(report.final_step, last_trained)
        expected = newest()
        if progress:
            print(
                f"trial {trial + 1}/{trials}: restored {restored}, trained to {last_trained}, "
                f"in-flight save killed: {bool(saves - committed)}, newest committed now {expected}",
                flush=True,
            )
    storage = open_storage(root, options)
    report.leftover_uncommitted = sum(1 for i in list_checkpoints(storage) if i.status == "uncommitted")
    if isinstance(storage, S3Storage):
        report.open_multipart_uploads = len(storage.open_uploads())
    report.seconds = round(time.monotonic() - started, 1)
    return report
