"""Issue 29, "a user's second hour" (points 1-6, 10, 11): each through the real ``ckpt`` command, as a user runs it.

Refusals are one ``ckpt: error:`` line, exit 2 (1 for damage), nothing written; listings find what is there and say
its state as ``verify`` would; every count, label and plural is right.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt
from tests.cli_helpers import FIX, ROOT, assert_one_error, ckpt_cli, tree

TAG = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
CONVERTED_TAG = FIX / "nxd_from_full_tp2_pp2"  # NxD converter output: model/ only, no step in any file
CONFIG = FIX / "config.json"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cuda_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Our CUDA-layout checkpoint of the NxD fixture (model + optimizer + scheduler), converted by the CLI."""
    dst = tmp_path_factory.mktemp("conv") / "cuda"
    r = ckpt_cli("convert", TAG, dst, "--to", "cuda", "--config", CONFIG)
    assert r.returncode == 0, r.stderr
    return dst


@pytest.fixture(scope="module")
def trainer_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real HF Trainer output folder: ``examples/hf_trainer.py``, 10 steps, ``checkpoint-5`` and ``checkpoint-10``."""
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("trainer") / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "USE_TORCH_XLA": "0", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--out", str(out), "--steps", "10"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-5"]
    return out


# ------------------------------------------------------------------------------------------------ 1: DST


@pytest.mark.parametrize("where", ["ancestor", "used"])
def test_every_format_refuses_a_used_dst_with_one_message(tmp_path: Path, where: str) -> None:
    """``convert runs/exp1/step_3 runs`` wrote our manifest beside the user's files; hf/nxd refused in their own
    words, after work.  Now every format refuses before any work, in the same words."""
    runs = tmp_path / "runs"
    src = runs / "exp1" / "step_3"
    shutil.copytree(TAG, src)
    (runs / "notes.txt").write_text("mine")
    dst = runs if where == "ancestor" else runs / "exp1"
    if where == "used":
        src = tmp_path / "src"
        shutil.copytree(TAG, src)
    before = tree(tmp_path)
    lines = set()
    for fmt, to in (
        ("ckpt", "cuda"),
        ("hf", "cuda"),
        ("dcp", "cuda"),
        ("hf-trainer", "cuda"),
        ("nxd", "neuron"),
    ):
        r = ckpt_cli("convert", src, dst, "--to", to, "--format", fmt, "--config", CONFIG)
        lines.add(assert_one_error(r, f"DST {dst} already exists"))
        dry = ckpt_cli("convert", src, dst, "--to", to, "--format", fmt, "--config", CONFIG, "--dry-run")
        lines.add(assert_one_error(dry, f"DST {dst} already exists"))
        assert tree(tmp_path) == before, fmt
    assert len(lines) == 1, lines  # one message, whatever the format
    assert ("holds SRC" in next(iter(lines))) == (where == "ancestor")


def test_ctrl_c_during_a_convert_leaves_no_dst_folder(tmp_path: Path) -> None:
    """SIGINT while writing: exit 130, one line, and DST (a folder that did not exist) is gone."""
    src = tmp_path / "hf"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIX / name, src / name)
    dst = tmp_path / "out" / "ck"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CONVERT, str(src), str(dst), str(tmp_path / "started")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PJRT_DEVICE": "CPU"},
    )  # fmt: skip
    try:
        for _ in range(600):
            if (tmp_path / "started").exists() or proc.poll() is not None:
                break
            import time

            time.sleep(0.1)
        assert (tmp_path / "started").exists(), proc.communicate()[1][-2000:]
        assert dst.is_dir()  # the conversion is writing there now
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.strip() == "ckpt: interrupted", err[-2000:]
    assert not (tmp_path / "out").exists(), tree(tmp_path / "out")


#: ``ckpt convert SRC DST --to cuda --step 1`` whose progress callback signals once data is being written and then
#: waits for the interruption (so that the test's Ctrl-C lands mid-write, every time); the writer flushes each
#: tensor as it comes, so DST exists by then
_SLOW_CONVERT = """
import dataclasses, sys, time
from pathlib import Path
import ckpt.cli.convert as c
real = c._run
def slow_run(run_convert, src, dst, opts, run, as_json):
    run = dataclasses.replace(run, flush_bytes=1)  # every tensor goes to DST's data file at once
    def convert(*a, progress=None, **k):
        def tick(n):
            progress(n)
            Path(sys.argv[3]).touch()
            time.sleep(60)
        return run_convert(*a, progress=tick, **k)
    return real(convert, src, dst, opts, run, as_json)
c._run = slow_run
from ckpt.cli.main import main
main(["convert", sys.argv[1], sys.argv[2], "--to", "cuda", "--step", "1"])
"""


# ------------------------------------------------------------------------------------------------ 2: parts of a tag


def test_the_model_folder_of_a_tag_points_at_the_tag(tmp_path: Path) -> None:
    """``convert tag/model`` wrote 39 weights at step 0 and said nothing of the optimizer, scheduler and step."""
    for cmd in (("convert", TAG / "model", tmp_path / "o", "--to", "cuda"), ("inspect", TAG / "model"),
                ("verify", TAG / "optim")):  # fmt: skip
        r = ckpt_cli(*cmd)
        line = assert_one_error(r, f"NxD tag {TAG}", "optim" if cmd[0] != "verify" else "scheduler.pt")
        assert str(TAG) in line.rsplit(":", 1)[-1] or f"ckpt {cmd[0]} {TAG}" in line, line
    assert tree(tmp_path) == {}


def test_a_tag_whose_optimizer_is_gone_is_damaged(tmp_path: Path) -> None:
    """``done`` but no ``optim/``: verify said ok and convert wrote weights only; now both say what is missing."""
    tag = tmp_path / "tags" / "step_3"
    shutil.copytree(TAG, tag)
    shutil.rmtree(tag / "optim")
    assert_one_error(ckpt_cli("verify", tag), "optim", code=1)
    assert_one_error(
        ckpt_cli("convert", tag, tmp_path / "o", "--to", "cuda", "--config", CONFIG), "optim", code=1
    )
    assert not (tmp_path / "o").exists()
    listed = ckpt_cli("ls", tag.parent, "--json")
    assert listed.returncode == 1 and [r["status"] for r in json.loads(listed.stdout)] == ["damaged"]
    (tag / "optim").mkdir()  # an empty optim/ folder is no better
    assert_one_error(ckpt_cli("verify", tag), "optim", code=1)


# ------------------------------------------------------------------------------------------------ 3: steps


def test_a_step_no_file_records_is_unknown_never_a_names_digits(tmp_path: Path) -> None:
    tags = tmp_path / "tags"
    shutil.copytree(CONVERTED_TAG, tags / "llama_v7")  # its name has digits; its files no step
    listed = ckpt_cli("ls", tags, "--json")
    assert listed.returncode == 0, listed.stderr
    assert [(r["tag"], r["step"]) for r in json.loads(listed.stdout)] == [("llama_v7", None)]
    table = ckpt_cli("ls", tags)
    row = next(ln for ln in table.stdout.splitlines() if "llama_v7" in ln)
    assert row.split()[0] == "unknown", table.stdout
    doc = ckpt_cli("inspect", tags / "llama_v7", "--json")
    assert doc.returncode == 0 and json.loads(doc.stdout)["step"] is None, doc.stderr
    plan = ckpt_cli(
        "convert", tags / "llama_v7", tmp_path / "x", "--to", "cuda", "--config", CONFIG, "--dry-run"
    )
    assert "step: unknown" in plan.stdout, plan.stdout
    r = ckpt_cli("convert", tags / "llama_v7", tmp_path / "out", "--to", "cuda", "--config", CONFIG)
    (warning,) = r.stderr.splitlines()
    assert r.returncode == 0 and "records no training step" in warning and "--step N" in warning, r.stderr
    r = ckpt_cli(
        "convert", tags / "llama_v7", tmp_path / "s7", "--to", "cuda", "--config", CONFIG, "--step", "7"
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert ckpt.open_checkpoint(str(tmp_path / "s7")).manifest.step == 7


def test_agreeing_files_give_no_warning_whatever_the_name(tmp_path: Path) -> None:
    """A tag named ``tp4`` whose scheduler and user content both say step 3 warned "sources disagree"."""
    shutil.copytree(TAG, tmp_path / "tp4")
    r = ckpt_cli("inspect", tmp_path / "tp4", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["step"] == 3 and r.stderr == "", r.stderr


def test_the_name_hook_takes_only_what_a_strict_template_accepts() -> None:
    import re

    from ckpt.converters.nxd import step
    from ckpt.converters.nxd.files import scan_tag

    files = scan_tag(CONVERTED_TAG)
    assert step.tag_step(files) is None
    template = re.compile(r"nxd_from_full_tp(\d+)_pp(\d+)")
    step.NAME_TEMPLATES.append(lambda name: 11 if template.fullmatch(name) else None)
    try:
        assert step.tag_step(files) == 11
    finally:
        step.NAME_TEMPLATES.pop()


# ------------------------------------------------------------------------------------------------ 4: --step


def test_a_negative_step_is_refused(tmp_path: Path) -> None:
    r = ckpt_cli("convert", TAG, tmp_path / "o", "--to", "cuda", "--config", CONFIG, "--step", "-5")
    assert_one_error(r, "--step", "-5")
    assert tree(tmp_path) == {}
    from ckpt.converters.options import ConvertOptions

    with pytest.raises(ckpt.CkptError, match="non-negative"):
        ConvertOptions(to="cuda", step=-5)


# ------------------------------------------------------------------------------------------------ 5, 6: ls


def test_ls_finds_every_kind_of_checkpoint(tmp_path: Path, cuda_ckpt: Path, trainer_out: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(cuda_ckpt, out / "s")  # a converted checkpoint, named as the guide names DSTs
    shutil.copytree(cuda_ckpt, out / "conv" / "gpu-500")
    r = ckpt_cli("ls", out, "--json")
    assert r.returncode == 0, r.stderr
    assert sorted((x["format"], x["name"], x["status"]) for x in json.loads(r.stdout)) == [
        ("ckpt", "conv/gpu-500", "committed"),
        ("ckpt", "s", "committed"),
    ]
    mixed = tmp_path / "mixed"
    shutil.copytree(TAG, mixed / "step_3")
    shutil.copytree(cuda_ckpt, mixed / "step_00000003")
    rows = json.loads(ckpt_cli("ls", mixed, "--json").stdout)
    assert sorted((x["format"], x["status"]) for x in rows) == [("ckpt", "committed"), ("nxd", "complete")]
    table = ckpt_cli("ls", mixed)
    assert table.returncode == 0 and "uncommitted" not in table.stdout and "(NxD)" in table.stdout, (
        table.stdout
    )
    r = ckpt_cli("ls", trainer_out, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["format"], x["name"], x["step"], x["status"]) for x in rows] == [
        ("hf-trainer", "checkpoint-5", 5, "ok"),
        ("hf-trainer", "checkpoint-10", 10, "ok"),
    ]
    table = ckpt_cli("ls", trainer_out, env={"PJRT_DEVICE": ""})
    assert "checkpoint-10" in table.stdout and "PJRT" not in table.stderr, table.stderr


def test_a_damaged_nxd_tag_is_listed_damaged(tmp_path: Path) -> None:
    root = tmp_path / "tags"
    tag = root / "step_3"
    shutil.copytree(TAG, tag)
    victim = tag / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt"
    victim.write_bytes(victim.read_bytes()[:-300])  # truncated
    r = ckpt_cli("ls", root, "--json")
    assert r.returncode == 1 and [x["status"] for x in json.loads(r.stdout)] == ["damaged"], r.stdout
    table = ckpt_cli("ls", root)
    (row,) = [ln for ln in table.stdout.splitlines() if "step_3" in ln]
    assert table.returncode == 1 and row.split()[9] == "damaged" and "truncated" in row, table.stdout
    assert "1 of 1 checkpoint under" in table.stderr, table.stderr


# ------------------------------------------------------------------------------------------------ 10: edges


def test_odd_inputs_and_outputs_are_one_line(tmp_path: Path, cuda_ckpt: Path) -> None:
    assert_one_error(ckpt_cli("inspect", FIX / "model.safetensors"), "is a file", f"ckpt inspect {FIX}")
    r = ckpt_cli("no-such-command", "a")
    line = assert_one_error(r, "no-such-command")
    assert "Usage" not in r.stderr and "ckpt --help" in line
    # the reader of a pipe left: no "exit 1" (damage) and nothing on stderr
    for args in (("inspect", cuda_ckpt), ("ls", cuda_ckpt.parent)):
        proc = subprocess.Popen([sys.executable, "-m", "ckpt", *map(str, args)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={**os.environ, "PJRT_DEVICE": "CPU"})  # fmt: skip
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 141 and err == b"", (args, proc.returncode, err)
    # nxd into an existing tag: no library hint (overwrite=True) on the command line; hf: no warning first
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("x")
    r = ckpt_cli("convert", cuda_ckpt, used, "--to", "neuron", "--format", "nxd", "--tp", "2")
    assert "overwrite" not in assert_one_error(r, "already exists")
    r = ckpt_cli("convert", cuda_ckpt, used, "--to", "cuda", "--format", "hf")
    assert_one_error(r, "already exists")  # exactly one line: no "not written" warning before it


# ------------------------------------------------------------------------------------------------ 11: labels


def test_counts_and_plurals(tmp_path: Path, cuda_ckpt: Path) -> None:
    r = ckpt_cli("inspect", cuda_ckpt)
    head = r.stdout.splitlines()[0]
    assert "in 1 file " in head and "1 files" not in head, head
    assert " 1 pieces" not in r.stdout and "1 piece" in r.stdout and "group(s)" not in r.stdout, r.stdout
    for line in r.stdout.splitlines():
        if line.startswith("optimizer:"):
            assert "param group" in line and "NeuronZero1" not in line, line
    assert "world_size=1" in head, head  # one full copy, not the 4 Neuron ranks it came from
    damaged = tmp_path / "damaged"
    shutil.copytree(cuda_ckpt, damaged)
    data = next(damaged.glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF
    data.write_bytes(bytes(raw))
    v = ckpt_cli("verify", damaged)
    # one damaged file, one line (issue 37: no per-tensor repeats, no count line)
    assert v.returncode == 1 and len(v.stderr.splitlines()) == 1 and "(s)" not in v.stderr, v.stderr
    one = ckpt_cli("convert", TAG.parent, tmp_path / "x", "--to", "cuda")
    line = assert_one_error(one, "one NxD tag, step_3")
    assert "1 NxD tag" not in line and "not one" not in line, line


def test_hf_to_hf_says_nothing_of_step_0(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIX / name, hf / name)
    plan = ckpt_cli("convert", hf, tmp_path / "o", "--to", "cuda", "--format", "hf", "--dry-run")
    assert plan.returncode == 0 and "step: unknown" in plan.stdout and plan.stderr == "", (
        plan.stdout + plan.stderr
    )
    r = ckpt_cli("convert", hf, tmp_path / "o", "--to", "cuda", "--format", "hf")
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_dcp_writer_of_cpu_tensors_is_listed_as_cpu_whole_tensors(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpt.dcp import Writer

    model = torch.nn.Linear(4, 2)
    dcp.save(
        {"model": model.state_dict()}, storage_writer=Writer(str(tmp_path / "run" / "step_00000001"), step=1)
    )
    (row,) = json.loads(ckpt_cli("ls", tmp_path / "run", "--json").stdout)
    assert (row["backend"], row["layout"]["kind"]) == ("cpu", "replicated"), row


def test_trainer_folders_convert_count_and_report(tmp_path: Path, trainer_out: Path) -> None:
    src = trainer_out / "checkpoint-10"
    r = ckpt_cli("convert", src, tmp_path / "t", "--to", "cuda", "--format", "hf-trainer", "--json")
    assert r.returncode == 0, r.stderr
    import torch

    moments = torch.load(tmp_path / "t" / "optimizer.pt", weights_only=True)["state"]
    n_moments = sum(1 for s in moments.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    from safetensors import safe_open

    n_params = 0
    for shard in (tmp_path / "t").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            n_params += len(list(f.keys()))
    assert json.loads(r.stdout)["tensors"] == n_params + n_moments, (r.stdout, n_params, n_moments)
    only = tmp_path / "only"
    shutil.copytree(trainer_out / "checkpoint-10", only / "checkpoint-10")
    rep = ckpt_cli("report", only)
    assert rep.returncode == 0, rep.stderr
    assert "killed" not in rep.stdout and "(0 B)" not in rep.stdout, rep.stdout
    assert "unknown" in rep.stdout, rep.stdout
