"""Every ``ckpt`` command as a user runs it (a real subprocess): its happy path and its most likely bad inputs.

One small checkpoint root, one HF folder and two simulated training logs are made once for the module.  Commands
that touch no tensor are run through a tiny wrapper that also reports whether ``torch`` ended up in
``sys.modules`` (issue 18: ``ckpt --help`` took 3-4 s and 650 MB because torch was imported at startup).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_helpers import FIX, assert_one_error, ckpt_cli, tree

pytestmark = pytest.mark.timeout(300)

#: runs the real command in-process and writes whether torch was imported to the file named by $CKPT_MODULES_OUT
WRAPPER = """
import os, sys
from ckpt.cli.main import cli
code = 0
try:
    cli.main(args=sys.argv[1:], prog_name="ckpt")
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
with open(os.environ["CKPT_MODULES_OUT"], "w") as f:
    f.write("\\n".join(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torch_xla", "numpy"))))
sys.exit(code)
"""


def run_watched(tmp: Path, *args: str | os.PathLike[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """The command, plus the torch / torch_xla / numpy modules it imported."""
    marker = tmp / f"modules-{len(list(tmp.glob('modules-*')))}.txt"
    r = subprocess.run(
        [sys.executable, "-c", WRAPPER, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CKPT_MODULES_OUT": str(marker)},
    )
    return r, [m for m in marker.read_text().splitlines() if m]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch

    import ckpt
    from tests.test_resume_sim import simulate

    base = tmp_path_factory.mktemp("smoke")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    mgr = ckpt.CheckpointManager(str(base / "run" / "checkpoints"), async_save=False)
    for step in (10, 20):
        mgr.save(step, model=model, optimizer=opt)
    hf = base / "hf"
    hf.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIX / name, hf / name)
    return {
        "root": base / "run" / "checkpoints",
        "ckpt": base / "run" / "checkpoints" / "step_00000020",
        "hf": hf,
        "log_a": simulate(base / "log_a", "correct"),
        "log_b": simulate(base / "log_b", "correct"),
        "out": base / "out",
        "tmp": base,
    }


# ------------------------------------------------------------------------------------------------ no torch


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--help"], "Commands:"),
        (["--version"], "ckpt, version"),
        (["convert", "--help"], "Examples:"),
        (["ls", "{root}"], "committed"),
        (["ls", "{root}", "--json"], '"layout"'),
        (["inspect", "{ckpt}"], "optim/1.bias/exp_avg_sq"),
        (["inspect", "{ckpt}/manifest.json", "--json"], '"optimizer_state"'),
        (["report", "{log_a}"], "Recovery cost per failure"),
        (["report", "{log_a}", "--json"], '"sessions": 2'),
        (["verify-resume", "{log_a}"], "CONTINUOUS at 1 boundary"),
        (["verify-resume", "{log_a}", "--json"], '"status": "pass"'),
        (["compare", "{log_a}", "{log_b}"], "what"),
    ],
)
def test_commands_that_touch_no_tensor_run_without_torch(
    inputs: dict[str, Path], args: list[str], expect: str
):
    r, modules = run_watched(inputs["tmp"], *(a.format(**inputs) for a in args))
    assert r.returncode == 0, r.stderr[-3000:]
    assert expect in r.stdout, r.stdout[-3000:]
    assert "torch" not in modules and not [m for m in modules if m.startswith("torch.")], modules


def test_the_wrapper_sees_torch_when_a_command_needs_it(inputs: dict[str, Path]) -> None:
    """The control for the test above: ``verify`` reads tensors, and the wrapper reports torch."""
    r, modules = run_watched(inputs["tmp"], "verify", inputs["ckpt"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torch" in modules


# ------------------------------------------------------------------------------------------------ happy paths


def test_verify_convert_and_their_json(inputs: dict[str, Path]) -> None:
    ok = ckpt_cli("verify", inputs["ckpt"])
    assert ok.returncode == 0 and ok.stdout.startswith("ok "), ok.stderr
    doc = json.loads(ckpt_cli("verify", inputs["hf"], "--json").stdout)
    assert doc["ok"] is True and doc["format"] == "hf" and doc["checksums"] is False
    out = inputs["out"]
    plan = ckpt_cli("convert", inputs["ckpt"], out / "plan", "--to", "cuda", "--dry-run", "--json")
    assert plan.returncode == 0 and json.loads(plan.stdout)["tensors"] == 12, plan.stderr
    assert not (out / "plan").exists()
    done = ckpt_cli("convert", inputs["hf"], out / "nxd", "--to", "neuron", "--format", "nxd", "--tp", "2",
                    "--step", "5", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["format"] == "nxd" and (out / "nxd" / "done").is_file()
    back = ckpt_cli("convert", out / "nxd", out / "hf", "--to", "cuda", "--format", "hf", "--config",
                    FIX / "config.json")  # fmt: skip
    assert back.returncode == 0 and "converted" in back.stdout, back.stderr
    ins = ckpt_cli("inspect", out / "nxd")
    assert ins.returncode == 0 and "NxD tag" in ins.stdout, ins.stderr


def test_demo_help_and_its_top_bad_input(inputs: dict[str, Path]) -> None:
    r = ckpt_cli("demo", "--help")
    assert r.returncode == 0 and "--kill-at" in r.stdout
    assert_one_error(ckpt_cli("demo", "--kill-at", "3", "--dir", inputs["tmp"] / "demo"), "--kill-at 3")
    assert not (inputs["tmp"] / "demo").exists()


# ------------------------------------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    "args, needles",
    [
        (["ls", "{tmp}/nope"], ["nope", "no such directory"]),
        (["ls", "{ckpt}"], ["is a checkpoint", "ckpt inspect"]),
        (["inspect", "{tmp}/nope"], ["nope"]),
        (["inspect", "{root}"], ["holds 2 checkpoints", "step_00000020"]),
        (["verify", "{tmp}/nope"], ["nope"]),
        (["report", "{tmp}/nope"], ["nope"]),
        (["verify-resume", "{tmp}/nope"], ["nope"]),
        (["compare", "{log_a}", "{tmp}/nope"], ["nope"]),
        (["convert", "{tmp}/nope", "{out}/x", "--to", "cuda"], ["nope", "no such file"]),
        (["convert", "{ckpt}", "{ckpt}/inside", "--to", "cuda"], ["inside SRC"]),
        (["convert", "{ckpt}", "s3:/bucket/x", "--to", "cuda"], ["s3://bucket/x"]),
        (["convert", "{ckpt}", "{out}/x", "--to", "cuda", "--format", "nxd"], ["--to neuron"]),
        (["convert", "{hf}", "{out}/x", "--to", "cuda", "--codec", "zstd", "--format", "hf"], ["--codec"]),
        (["convert", "{hf}", "{out}/x", "--to", "cuda", "--config", "{tmp}/none.json"], ["none.json"]),
    ],
)
def test_top_bad_inputs_are_one_line(inputs: dict[str, Path], args: list[str], needles: list[str]) -> None:
    before = tree(inputs["tmp"])
    r = ckpt_cli(*(a.format(**inputs) for a in args))
    assert_one_error(r, *(n.format(**inputs) for n in needles))
    assert tree(inputs["tmp"]) == before  # nothing written anywhere (SRC untouched, no DST)


def test_a_usage_error_exits_2_without_a_traceback() -> None:
    r = ckpt_cli("ls", "--no-such-flag")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--no-such-flag" in r.stderr


def test_wrong_level_refusals_need_no_torch(inputs: dict[str, Path]) -> None:
    for args in (["ls", inputs["ckpt"]], ["inspect", inputs["root"]]):
        r, modules = run_watched(inputs["tmp"], *args)
        assert_one_error(r)
        assert "torch" not in modules, (args, modules)
    r, modules = run_watched(inputs["tmp"], "ls", inputs["root"].parent)  # one level up: listed (issue 29)
    assert r.returncode == 0 and "checkpoints/step_00000020" in r.stdout, r.stdout + r.stderr
    assert "torch" not in modules, modules
