"""The README's demo command, end to end, as a user runs it; and its flags refused up front."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def demo(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckpt", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def test_demo_runs_end_to_end(tmp_path):
    workdir = tmp_path / "demo"
    r = demo("--dir", str(workdir), "--steps", "12", "--kill-at", "8")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resume is bit-exact" in r.stdout
    assert "CONTINUOUS" in r.stdout
    assert "bit-identical" in r.stdout and "round trip" in r.stdout
    assert (workdir / "crashed" / "resume.png").stat().st_size > 0
    assert (workdir / "crashed" / "converted-neuron-tp2" / "manifest.json").exists()
    # the ranks' chatter (gloo's connection lines on stdout, torch-xla's PJRT warning) stays in their logs
    for text in (r.stdout, r.stderr):
        assert "[Gloo]" not in text and "PJRT" not in text and "Traceback" not in text
    assert "[Gloo] Rank 0 is connected" in (workdir / "logs" / "reference.rank0.log").read_text()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--kill-at", "3"], "--kill-at 3: expected a step from 6 to 29"),  # before the first checkpoint
        (["--kill-at", "50", "--steps", "10"], "--kill-at 50: expected a step from 6 to 9"),  # never crashes
        (
            ["--kill-at", "10", "--steps", "10"],
            "--kill-at 10: expected a step from 6 to 9",
        ),  # at the last step
        (["--steps", "6", "--kill-at", "6"], "--steps 6: expected 7 or more"),
        (["--ranks", "0"], "--ranks 0: expected 1 or more"),
    ],
)
def test_flags_that_cannot_show_a_crash_are_refused_up_front(tmp_path, args, needle):
    workdir = tmp_path / "demo"
    r = demo("--dir", str(workdir), *args, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("ckpt: error: ") and r.stderr.count("\n") == 1
    assert needle in r.stderr and r.stdout == ""
    assert not workdir.exists()


def test_a_folder_that_is_not_a_demos_is_never_emptied(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    r = demo("--dir", str(tmp_path), timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(f"ckpt: error: --dir {tmp_path}: holds notes.txt")
    assert r.stderr.count("\n") == 1 and (tmp_path / "notes.txt").read_text() == "mine"


def _with_fault(tmp_path, code: str) -> dict[str, str]:
    """Environment whose Python processes run ``code`` at start-up (a sitecustomize): the demo's ranks break."""
    hook = tmp_path / "fault"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('RANK') is not None:  # the demo's training ranks only\n" + code
    )
    return {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize(
    "fault, needle",
    [
        (  # the crashing run's saves never commit: the restart starts over and repeats the reference's losses
            "    import sys, ckpt.manager\n"
            "    if '--kill-at' in sys.argv:\n"
            "        ckpt.manager.CheckpointManager.save = lambda self, *a, **k: None\n",
            r"no checkpoint had committed before the crash, so there was nothing to resume from",
        ),
        (  # the restore forgets the RNG streams: attention dropout draws other masks
            "    import ckpt.state.rng\n    ckpt.state.rng.restore_across = lambda *a, **k: ([], [])\n",
            r"after the resume differ from the reference run \(first: step (6|11)\)",
        ),
    ],
    ids=["nothing-committed", "rng-not-restored"],
)
def test_demo_fails_when_the_restore_is_broken(tmp_path, fault, needle):
    env = _with_fault(tmp_path, fault)
    r = subprocess.run(
        [sys.executable, "-m", "ckpt", "demo", "--dir", str(tmp_path / "demo"), "--ranks", "1", "--steps", "12",
         "--kill-at", "11"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore", **env},
    )  # fmt: skip
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(needle, r.stderr) and r.stderr.count("\n") == 1, r.stderr
    assert "resume is bit-exact" not in r.stdout
