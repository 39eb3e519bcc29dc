"""The ckpt command as a user runs it (a real subprocess): ls, inspect, verify, and errors on bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckpt
from ckpt.format.manifest import seal


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpt", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture()
def root(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 64)).sum().backward()
    opt.step()
    for step in (10, 20, 30):
        ckpt.save(str(tmp_path / f"step_{step:08d}"), step=step, model=m, optimizer=opt)
    os.makedirs(tmp_path / "step_00000040")  # a crashed save: no manifest
    return tmp_path


def _data_file(path) -> str:
    return next(f for f in os.listdir(path) if f.endswith(".safetensors"))


def test_ls_lists_by_step_with_status(root):
    r = run("ls", str(root), "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["step"], x["status"]) for x in rows] == [
        (10, "committed"),
        (20, "committed"),
        (30, "committed"),
        (40, "uncommitted"),
    ]
    table = run("ls", str(root))
    assert table.returncode == 0 and "uncommitted" in table.stdout and "cpu" in table.stdout


def test_inspect_json_lists_tensors_roles_and_optimizer(root):
    r = run("inspect", str(root / "step_00000020"), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["step"] == 20
    assert doc["tensors"]["0.weight"]["shape"] == [32, 64]
    assert doc["tensors"]["optim/0.weight/exp_avg"]["role"] == "optimizer_state"
    assert doc["optimizer"]["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    human = run("inspect", str(root / "step_00000020"))
    assert human.returncode == 0 and "optim/1.bias/exp_avg_sq" in human.stdout


def test_verify_ok_then_damaged_names_file_and_tensor(root):
    ck = root / "step_00000030"
    ok = run("verify", str(ck))
    assert ok.returncode == 0, ok.stderr
    assert "ok" in ok.stdout
    data = ck / _data_file(ck)
    raw = bytearray(data.read_bytes())
    man = ckpt.open_checkpoint(str(ck)).manifest
    shard = man.tensors["0.weight"].shards[0]
    raw[shard.offset + 5] ^= 0x40
    data.write_bytes(bytes(raw))
    bad = run("verify", str(ck))
    assert bad.returncode == 1
    assert data.name in bad.stderr and "'0.weight'" in bad.stderr and "checksum" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_verify_truncated_and_missing_files(root):
    ck = root / "step_00000010"
    data = ck / _data_file(ck)
    data.write_bytes(data.read_bytes()[:-100])
    r = run("verify", str(ck))
    assert r.returncode == 1 and "truncated" in r.stderr and data.name in r.stderr
    data.unlink()
    r = run("verify", str(ck))
    assert r.returncode == 1 and "missing" in r.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (("verify", "/no/such/dir"), "no such checkpoint directory"),
        (("inspect", "/no/such/dir"), "no such checkpoint directory"),
        (("ls", "/no/such/dir"), "no such directory"),
        (("verify-resume", "/no/such/run"), "/no/such/run"),
        (("report", "/no/such/run"), "/no/such/run"),
        (("compare", "/no/such/run", "/no/such/other"), "/no/such/run"),
        (("convert", "/no/such/dir", "/tmp/never-written", "--to", "cuda"), "/no/such/dir"),
    ],
)
def test_bad_paths_one_line_exit_2(args, needle):
    """Every command reports a user error the same way: one stderr line starting ``ckpt: error:``, exit 2."""
    r = run(*args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.strip().startswith("ckpt: error: "), r.stderr  # (convert emits a blank line first)


def test_not_a_checkpoint_and_damaged_manifest_exit_2(root, tmp_path):
    r = run("inspect", str(root / "step_00000040"))
    assert r.returncode == 2 and "manifest.json missing" in r.stderr
    ck = root / "step_00000020"
    raw = bytearray((ck / "manifest.json").read_bytes())
    # one flipped bit, '2026' -> '3026': still valid JSON, only the manifest's own checksum sees it
    raw[raw.index(b'"created_at":"') + 14] ^= 0x01
    (ck / "manifest.json").write_bytes(bytes(raw))
    r = run("verify", str(ck))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"ckpt: error: {ck / 'manifest.json'} is damaged: "), r.stderr
    # a hand-written manifest without a checksum is damaged; sealed, it goes on to structural validation
    (ck / "manifest.json").write_text('{"format": "ckpt", "format_version": 1, "step": "x"}')
    r = run("verify", str(ck))
    assert r.returncode == 2 and "checksum is missing" in r.stderr and "Traceback" not in r.stderr
    (ck / "manifest.json").write_text(seal({"format": "ckpt", "format_version": 1, "step": "x"}))
    r = run("verify", str(ck))
    assert r.returncode == 2 and "step" in r.stderr and "Traceback" not in r.stderr
    (ck / "manifest.json").write_text("{not json")
    r = run("inspect", str(ck))
    assert r.returncode == 2 and "not valid JSON" in r.stderr
    ls = run("ls", str(root), "--json")
    statuses = {x["step"]: x["status"] for x in json.loads(ls.stdout)}
    assert statuses[20] == "damaged"


def test_unknown_option_is_a_usage_error():
    r = run("verify", "--bogus")
    assert r.returncode == 2 and "No such option" in r.stderr


# -- one way for errors; startup without torch; Ctrl-C ---------------------------------------------------------


def test_click_runner_and_the_real_command_report_an_error_the_same_way(root):
    """The group reports errors (cli/group.py), so the test runner sees exactly what a user's shell sees."""
    from ckpt.cli.main import cli
    from click.testing import CliRunner

    for args in (("ls", "/no/such/dir"), ("inspect", str(root / "step_00000040"))):
        real = run(*args)
        runner = CliRunner().invoke(cli, list(args))
        assert (runner.exit_code, runner.output) == (real.returncode, real.stderr) == (2, real.stderr)
        assert real.stderr.startswith("ckpt: error: ") and real.stderr.count("\n") == 1


def _imported(stderr: str) -> set[str]:
    """Top-level names of the modules a ``python -X importtime`` run imported (its report is on stderr)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def run_importtime(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ckpt", *args], capture_output=True, text=True, timeout=120
    )


def test_importtime_report_sees_torch():
    """The control for the test below: the same report does list torch when a library name that needs it is
    used."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import ckpt; ckpt.Checkpointer"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "torch" in _imported(r.stderr) and "click" not in _imported(r.stderr)


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    from test_resume_sim import simulate

    return simulate(tmp_path_factory.mktemp("run"), "correct")


@pytest.mark.parametrize(
    "args, expect",
    [
        (("--help",), "Commands:"),
        (("--version",), "ckpt, version"),
        (("convert", "--help"), "--workers"),
        (("ls", "{root}"), "committed"),
        (("ls", "{root}", "--json"), '"committed"'),
        (("inspect", "{root}/step_00000020"), "optim/1.bias/exp_avg_sq"),
        (("inspect", "{root}/step_00000020", "--json"), '"optimizer_state"'),
        (("report", "{run}"), "Recovery cost"),
        (("verify-resume", "{run}"), "CONTINUOUS"),
    ],
)
def test_commands_that_touch_no_tensor_do_not_import_torch(root, logged_run, args, expect):
    """``ckpt --help`` and the manifest/log commands start without torch (issue 18: 3-4 s and 650 MB before)."""
    r = run_importtime(*(a.format(root=root, run=logged_run) for a in args))
    assert r.returncode == 0, r.stderr[-3000:]
    assert expect in r.stdout
    imported = _imported(r.stderr)
    assert "click" in imported  # the report is there ...
    assert "torch" not in imported  # ... and torch is not in it


def _sizable_checkpoint(path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(32)])  # 128 MiB in 64 tensors
    ckpt.save(str(path), step=1, model=model)


def _loaded(pid: int, library: str) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return library in f.read()
    except OSError:
        return False


def _cmdline(proc) -> str:
    """A child's command line, or "" when it is gone or not readable yet (a spawn helper can end between the
    listing and the read)."""
    try:
        return " ".join(proc.cmdline())
    except Exception:  # psutil.NoSuchProcess / AccessDenied, or the OSError psutil lets through
        return ""


@pytest.mark.parametrize("when", ["importing torch", "workers importing torch", "workers writing"])
def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, when):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while the command imports torch, while
    the spawned workers of ``convert --workers 2`` import torch (outside any task: without care each prints a
    traceback) and while they write DST: one line, exit 130, no traceback from the command or any worker, no
    worker left running, no data file left."""
    psutil = pytest.importorskip("psutil")
    src, dst = tmp_path / "src", tmp_path / "dst"
    _sizable_checkpoint(src)
    p = subprocess.Popen(
        [sys.executable, "-m", "ckpt", "convert", str(src), str(dst), "--to", "cuda", "--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, so that the signal reaches exactly it and its workers
        # as from a terminal: a runner started in the background (``cmd &``) passes SIGINT down ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    workers: list = []
    try:
        while p.poll() is None:
            if when == "importing torch" and _loaded(p.pid, "libtorch"):
                break
            if when != "importing torch":
                workers = [c for c in psutil.Process(p.pid).children() if "spawn_main" in _cmdline(c)]
                if len(workers) == 2 and (
                    all(_loaded(w.pid, "libtorch") for w in workers)
                    if when == "workers importing torch"
                    else dst.is_dir() and any(dst.iterdir())
                ):
                    break
            time.sleep(0.02)
        assert p.poll() is None, "the conversion ended before it could be interrupted"
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert (p.returncode, err, out) == (130, "ckpt: interrupted\n", "")
    for w in workers:
        w.wait(timeout=30)  # raises if it is still running: the parent must have ended it
    assert not dst.exists() or not list(dst.iterdir())
    assert not [x.name for x in tmp_path.iterdir() if x.name not in ("src", "dst")]


def test_import_ckpt_is_lazy_and_every_export_resolves():
    code = (
        "import sys, ckpt\n"
        "assert 'torch' not in sys.modules\n"
        "missing = [n for n in ckpt.__all__ if getattr(ckpt, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert 'torch' in sys.modules and ckpt.save and ckpt.CheckpointManager.__module__ == 'ckpt.manager'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
