"""The example training script for real: SIGKILLed, resumed, verified; each broken resume named by its cause.

Every run here is ``examples/tiny_llama.py`` in its own process, checkpointing through the manager (which
writes its save/restore events into the ledger) and verified with the checkpoints' manifests as facts, as
``ckpt verify-resume RUN`` does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpt.cli.main import cli
from click.testing import CliRunner

from ckpt.resume.checks import Cause, Status
from ckpt.resume.cost import recovery_cost
from ckpt.resume.ledger import checkpoints_dir, ledger_path
from ckpt.resume.manifest_facts import ManifestFacts
from ckpt.resume.sources import load_run
from ckpt.resume.verify import Verification, verify_run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "tiny_llama.py"
STEPS, KILL_AT = 20, 13  # saves every 5: the crash leaves 10 committed (15 never started) and 11..13 logged

EXPECTED = {
    "scheduler_not_restored": Cause.WARMUP_RESTARTED,
    "rng_not_restored": Cause.RNG_NOT_RESTORED,
    "optimizer_dropped": Cause.OPTIMIZER_LOST,
    "data_position_lost": Cause.DATA_POSITION_LOST,
    "scheduler_last_epoch": Cause.LR_OFF_BY_ONE,
    "older_checkpoint": Cause.OLDER_CHECKPOINT,
}


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def train(run: Path, *args: object, check: bool = True, env: dict[str, str] | None = None) -> int:
    cmd = [sys.executable, str(SCRIPT), "--run", str(run), *map(str, args)]
    proc = subprocess.run(cmd, env=env or _env(), capture_output=True, text=True, timeout=300)
    if check and proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"{cmd} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.returncode


def verify(run: Path) -> Verification:
    facts = ManifestFacts(checkpoints_dir(run))
    return verify_run(load_run(run), facts=facts)


def problems(result: Verification) -> list[tuple[str, str, str]]:
    return [
        (c.name, c.status.value, c.summary)
        for v in result.verdicts
        for c in v.checks
        if c.status in (Status.WARN, Status.FAIL)
    ]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run SIGKILLed right after step 13; each test resumes its own copy."""
    run = tmp_path_factory.mktemp("crashed") / "run"
    assert train(run, "--steps", STEPS, "--kill-at", KILL_AT, "--kill-settled") == -signal.SIGKILL
    return run


def resumed_copy(crashed: Path, dest: Path, bug: str = "none") -> Path:
    run = dest / f"run-{bug}"
    shutil.copytree(crashed, run)
    assert train(run, "--steps", STEPS, "--bug", bug) == 0
    return run


@pytest.fixture(scope="module")
def correct(crashed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resumed_copy(crashed, tmp_path_factory.mktemp("correct"))


def test_correct_resume_passes_with_no_false_alarm(correct: Path) -> None:
    result = verify(correct)
    assert problems(result) == [] and result.exit_code == 0
    (v,) = result.verdicts
    assert v.deterministic and v.boundary.restored_step == 10 and v.boundary.overlap == [11, 12, 13]
    passed = {c.name for c in v.checks if c.status is Status.PASS}
    # Every check ran on real evidence: the checkpoint's manifest for the counters, the free A/B for the rest.
    assert passed == {"step", "counters", "lr", "data", "position", "rng", "lost_work", "env", "weights", "loss"}
    assert v.check("counters").numbers["scheduler_last_epoch"] == 10
    assert v.check("counters").numbers["checkpoint_samples"] == 80


def test_manager_writes_save_and_restore_events(correct: Path) -> None:
    run = load_run(correct)
    dead, post = run.sessions
    assert [s.step for s in dead.saves] == [5, 10] and dead.exit is None  # 15 was never reached
    assert [s.step for s in post.saves] == [15, 20] and post.exit is not None and post.exit.clean
    (restore,) = post.restores
    assert restore.step == 10 and restore.path.endswith("step_00000010") and restore.seconds > 0
    save = post.saves[0]
    assert 0 < save.blocking_seconds <= save.total_seconds and save.bytes > 0
    cost = recovery_cost(run)
    (f,) = cost.failures
    assert (f.crash_step, f.restored_step, f.steps_recomputed) == (13, 10, 3)
    assert f.restore_seconds == restore.seconds and f.downtime_seconds > 0 and cost.save_bytes > 0


@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_broken_resume_is_flagged_with_its_cause(crashed: Path, tmp_path: Path, bug: str) -> None:
    result = verify(resumed_copy(crashed, tmp_path, bug))
    assert result.exit_code == 1
    assert result.causes == [EXPECTED[bug]], problems(result)


def test_sigkill_at_an_arbitrary_moment_then_resume_passes(tmp_path: Path) -> None:
    # Killed from outside at a moment the script does not choose (possibly mid-step or mid async save).
    run = tmp_path / "run"
    cmd = [sys.executable, str(SCRIPT), "--run", str(run), "--steps", "16", "--step-sleep", "0.02"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        text = ledger_path(run).read_text() if ledger_path(run).exists() else ""
        # step 5's save committed (its ledger line is written at the commit) and step 8 logged: on a loaded
        # machine the async save of step 5 can still be in flight at step 8, and then nothing is there to restore
        if '"step":8,' in text and '{"kind":"save","step":5,' in text:
            break
        time.sleep(0.005)
    time.sleep(0.013)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert train(run, "--steps", 16) == 0
    result = verify(run)
    assert problems(result) == [] and result.exit_code == 0
    (v,) = result.verdicts
    assert v.boundary.restored_step in (5, 10) and v.check("loss").status is Status.PASS


def test_cli_verifies_with_checkpoint_facts_and_plots(correct: Path, tmp_path: Path) -> None:
    png = tmp_path / "resume.png"
    r = CliRunner().invoke(cli, ["verify-resume", str(correct), "--json", "--plot", str(png)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    counters = next(c for c in doc["boundaries"][0]["checks"] if c["check"] == "counters")
    assert counters["status"] == "pass"
    assert png.read_bytes()[:4] == b"\x89PNG"


REPLAY = (
    f"{sys.executable} {SCRIPT} --run {{run}} --resume-from {{checkpoint}} --stop-at {{stop}} --steps {STEPS}"
)


def test_replay_reproduces_the_logged_steps(correct: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(
        cli,
        [
            "verify-resume",
            str(correct),
            "--replay",
            REPLAY,
            "--from-step",
            "10",
            "--replay-steps",
            "4",
            "--json",
        ],
        env={"PYTHONWARNINGS": "ignore"},
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    rows = doc["replay"]["rows"]
    assert [row["step"] for row in rows] == [11, 12, 13, 14]
    assert all(row["loss_equal"] and row["lr_equal"] and row["rng_digest_equal"] for row in rows)
    assert doc["status"] == "pass" and doc["boundaries"][0]["restored_step"] == 10


def test_replay_of_a_broken_command_names_the_cause(correct: Path, tmp_path: Path) -> None:
    # Default --from-step: the newest checkpoint the log has steps after (15); default K: up to 10 steps.
    r = CliRunner().invoke(
        cli, ["verify-resume", str(correct), "--replay", REPLAY + " --bug rng_not_restored"]
    )
    assert r.exit_code == 1, r.output
    assert "replayed 5 steps from step 15" in r.output and "RNG not restored" in r.output


def test_replay_bad_input_exits_2(correct: Path) -> None:
    r = CliRunner().invoke(cli, ["verify-resume", str(correct), "--replay", "false"])
    assert r.exit_code == 2 and "replay command exited with code 1" in r.output
    r = CliRunner().invoke(cli, ["verify-resume", str(correct), "--replay", REPLAY, "--from-step", "7"])
    assert r.exit_code == 2 and "no committed checkpoint of step 7" in r.output


@pytest.mark.xla
def test_xla_cpu_device_kill_resume_verify(tmp_path: Path) -> None:
    pytest.importorskip("torch_xla")
    env = _env(PJRT_DEVICE="CPU")
    run = tmp_path / "run"
    args = ("--device", "xla", "--steps", 6, "--save-every", 2)
    assert train(run, *args, "--kill-at", 3, "--kill-settled", env=env) == -signal.SIGKILL
    assert train(run, *args, env=env) == 0
    result = verify(run)
    assert problems(result) == [] and result.exit_code == 0
    (v,) = result.verdicts
    assert v.boundary.overlap == [3] and v.check("loss").summary.endswith("equal bit for bit")
    assert v.check("counters").status is Status.PASS
    assert load_run(run).sessions[1].compiles  # XLA compilations are logged as compile events
