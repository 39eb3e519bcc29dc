"""``verify-resume`` and ``report`` commands: exit codes 0/1/2, JSON, plot, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt.cli.compare import compare
from ckpt.cli.main import cli
from ckpt.cli.report import report
from ckpt.cli.verify_resume import verify_resume
from click.testing import CliRunner
from test_resume_sim import simulate

from ckpt.resume.ledger import LedgerWriter, ledger_path


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return simulate(tmp_path_factory.mktemp("good"), "correct")


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return simulate(tmp_path_factory.mktemp("broken"), "scheduler_last_epoch")


def invoke(cmd, *args: str):
    """Run ``cmd`` as ``ckpt <cmd> ARGS`` does: through the group, which reports errors (cli/group.py)."""
    return CliRunner().invoke(cli, [cmd.name, *(str(a) for a in args)], terminal_width=200)


def test_continuous_run_exits_0(good: Path) -> None:
    r = invoke(verify_resume, good)
    assert r.exit_code == 0, r.output
    assert "CONTINUOUS" in r.output and "Boundary 1" in r.output


def test_discontinuity_exits_1_and_names_the_cause(broken: Path) -> None:
    r = invoke(verify_resume, broken)
    assert r.exit_code == 1
    assert "DISCONTINUITY" in r.output and "LR off by one" in r.output


def test_json_output(broken: Path) -> None:
    r = invoke(verify_resume, broken, "--json")
    assert r.exit_code == 1
    doc = json.loads(r.output)
    assert doc["exit_code"] == 1 and doc["causes"] == [
        "LR off by one (scheduler rebuilt with last_epoch / load order)"
    ]
    (b,) = doc["boundaries"]
    assert b["restored_step"] == 60 and b["first_step"] == 61 and b["overlap_steps"] == 15
    lr = next(c for c in b["checks"] if c["check"] == "lr")
    assert lr["status"] == "fail" and isinstance(lr["numbers"]["expected"], float)


def test_plot_writes_a_png(broken: Path, tmp_path: Path) -> None:
    out = tmp_path / "resume.png"
    r = invoke(verify_resume, broken, "--plot", out, "--no-deterministic")
    assert r.exit_code == 1
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_source_option(good: Path) -> None:
    assert invoke(verify_resume, good, "--source", "jsonl").exit_code == 0
    r = invoke(verify_resume, good, "--source", "tensorboard")
    assert r.exit_code == 2 and r.output.startswith("ckpt: error: no TensorBoard event files")


def _one_line_error(r) -> str:
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.output
    return lines[0]


def test_bad_input_exits_2_with_one_line(tmp_path: Path) -> None:
    assert "does not exist" in _one_line_error(invoke(verify_resume, tmp_path / "nope"))
    assert "no ledger.jsonl" in _one_line_error(invoke(verify_resume, tmp_path))
    ledger_path(tmp_path).write_text("")
    assert "no step records" in _one_line_error(invoke(verify_resume, tmp_path))
    with LedgerWriter(tmp_path) as w:
        w.step(1, 1.0, 0.1)
    with ledger_path(tmp_path).open("a") as fh:
        fh.write("{oops\n")
        fh.write('{"kind":"step","step":2,"loss":1.0,"lr":0.1,"session":"x"}\n')
    assert "ledger.jsonl:4: malformed" in _one_line_error(invoke(verify_resume, tmp_path))
    assert "does not exist" in _one_line_error(invoke(report, tmp_path / "nope"))


def test_single_session_has_nothing_to_verify(tmp_path: Path) -> None:
    with LedgerWriter(tmp_path) as w:
        for s in range(1, 5):
            w.step(s, 1.0, 0.1)
    r = invoke(verify_resume, tmp_path)
    assert r.exit_code == 0 and "No resume boundary" in r.output


def test_report_recovery_cost(good: Path) -> None:
    r = invoke(report, good)
    assert r.exit_code == 0 and "Recovery cost" in r.output and "killed" in r.output
    doc = json.loads(invoke(report, good, "--json").output)
    (f,) = doc["failures"]
    assert (f["crash_step"], f["restored_step"], f["steps_recomputed"]) == (75, 60, 15)
    assert f["restore_seconds"] == 0.01 and f["downtime_seconds"] >= 0
    assert doc["saves"] == 6 and doc["save_blocking_seconds"] == pytest.approx(6 * 0.002)


def test_rich_stays_at_the_cli_edge() -> None:
    # Every library module of ckpt.resume imported in a fresh interpreter: none of them pulls in rich (the
    # tables and colours live in cli/render_resume.py).
    import pkgutil
    import subprocess
    import sys

    import ckpt.resume

    names = [m.name for m in pkgutil.walk_packages(ckpt.resume.__path__, "ckpt.resume.")]
    assert {"ckpt.resume.report", "ckpt.resume.compare_report", "ckpt.resume.continuity"} <= set(names)
    code = (
        f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\nprint('rich' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_missing_checkpoints_root_and_unplottable_extension_are_one_line_errors(
    good: Path, tmp_path: Path
) -> None:
    line = _one_line_error(invoke(verify_resume, good, "--checkpoints", tmp_path / "nonexistent"))
    assert "--checkpoints" in line and "nonexistent" in line
    for args in ((verify_resume, good), (compare, good, good)):
        line = _one_line_error(invoke(*args, "--plot", tmp_path / "x.txt"))
        assert "x.txt" in line and ".png" in line and ".pdf" in line
        assert not (tmp_path / "x.txt").exists()


def test_one_overlapping_step_is_singular(tmp_path: Path) -> None:
    with LedgerWriter(tmp_path) as w:
        for s in range(1, 31):
            w.step(s, 2.0 + 0.01 * (s % 3), 0.1)
    with LedgerWriter(tmp_path) as w:
        w.restore(29, "ckpt/step-29")
        for s in range(30, 33):
            w.step(s, 2.0 + 0.01 * (s % 3), 0.1)
    r = invoke(verify_resume, tmp_path)
    assert "1 step overlaps" in r.output and "1 steps" not in r.output
