"""``ckpt convert`` as a command: impossible requests fail before any work (exit 2, one line, nothing written),
``--dry-run`` prints the plan, ``--workers N`` and torchrun-style ranks write disjoint shares and commit once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt.cli.main import cli
from click.testing import CliRunner

from ckpt import open_checkpoint
from ckpt.layouts import bit_equal
from tests.conftest import run_ranks

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "nxd" / "llama_gqa_h64"
TAG = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
CONFIG = FIX / "config.json"


@pytest.fixture(scope="module")
def cuda_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "cuda"
    r = CliRunner().invoke(
        cli, ["convert", str(TAG), str(out), "--from", "neuron", "--to", "cuda", "--config", str(CONFIG)]
    )
    assert r.exit_code == 0, r.output
    return out


def _tree(p: Path) -> list[str]:
    return sorted(str(x.relative_to(p)) for x in p.rglob("*")) if p.exists() else []


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--to", "neuron", "--tp", "3"], "--tp 3 does not divide"),
        (["--to", "neuron", "--tp", "4"], "num_key_value_heads"),  # 2 kv heads, tp 4 without --qkv-linear
        # SRC was converted from an NxD tag with qkv_linear, which the way back keeps unless told otherwise
        (
            ["--to", "neuron", "--tp", "2", "--kv-size-multiplier", "2", "--no-qkv-linear"],
            "needs --qkv-linear",
        ),
        (["--to", "neuron", "--pp", "8"], "exceed num_hidden_layers"),
        (["--to", "cuda", "--format", "nxd"], "use --to neuron"),
        (["--to", "neuron", "--format", "hf"], "CUDA layout"),
        (["--from", "neuron", "--to", "neuron"], "pass --from cuda"),
        (["--to", "cuda", "--workers", "0", "--format", "hf"], "--workers 0 must be >= 1"),
    ],
)
def test_cli_impossible_requests(cuda_ckpt: Path, tmp_path: Path, args: list[str], needle: str) -> None:
    dst = tmp_path / "dst"
    before = _tree(cuda_ckpt)
    r = CliRunner().invoke(cli, ["convert", str(cuda_ckpt), str(dst), *args])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("ckpt: error:"), r.output
    assert not dst.exists() and not list(tmp_path.iterdir())
    assert _tree(cuda_ckpt) == before


def test_cli_missing_config_and_unknown_layout(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["convert", str(TAG), str(tmp_path / "x"), "--to", "cuda"])
    assert (
        r.exit_code == 2
        and "pass --config config.json" in r.output
        and len(r.output.strip().splitlines()) == 1
    )
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.txt").write_text("x")
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "junk"), str(tmp_path / "y"), "--to", "cuda"])
    assert r.exit_code == 2 and "unknown checkpoint layout" in r.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_cli_refuses_existing_dst(cuda_ckpt: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["convert", str(cuda_ckpt), str(cuda_ckpt), "--to", "cuda"])
    assert r.exit_code == 2 and "same path" in r.output
    other = tmp_path / "o"
    assert CliRunner().invoke(cli, ["convert", str(cuda_ckpt), str(other), "--to", "cuda"]).exit_code == 0
    r = CliRunner().invoke(cli, ["convert", str(cuda_ckpt), str(other), "--to", "cuda"])
    assert r.exit_code == 2 and "already exists" in r.output


def test_cli_dry_run_writes_nothing(cuda_ckpt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    r = CliRunner().invoke(
        cli, ["convert", str(cuda_ckpt), str(dst), "--to", "neuron", "--tp", "2", "--qkv-linear", "--dry-run"]
    )
    assert r.exit_code == 0, r.output
    assert (
        "tensors: 105 (optimizer_state 70, parameter 35)" in r.output
        and "peak memory estimate" in r.output
        and "tp=2" in r.output
    )
    assert not dst.exists()


def test_cli_subprocess_and_progress(cuda_ckpt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "hf"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckpt",
            "convert",
            str(cuda_ckpt),
            str(dst),
            "--from",
            "cuda",
            "--to",
            "cuda",
            "--format",
            "hf",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "converted 39 tensors" in p.stdout  # what the HF folder holds; the moments left out are named
    assert "not written to" in p.stderr and "78 optimizer-state tensors" in p.stderr
    assert len(json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]) == 39
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckpt",
            "convert",
            str(cuda_ckpt),
            str(tmp_path / "z"),
            "--to",
            "neuron",
            "--tp",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "--tp 5" in p.stderr


def _same(a: Path, b: Path) -> None:
    ra, rb = open_checkpoint(str(a)), open_checkpoint(str(b))
    assert set(ra.names()) == set(rb.names())
    for n in ra.names():
        assert bit_equal(ra.read(n), rb.read(n)), n
    assert ra.manifest.optimizer == rb.manifest.optimizer


def test_cli_workers(cuda_ckpt: Path, tmp_path: Path) -> None:
    args = ["--to", "neuron", "--tp", "2", "--qkv-linear"]
    assert CliRunner().invoke(cli, ["convert", str(cuda_ckpt), str(tmp_path / "one"), *args]).exit_code == 0
    r = CliRunner().invoke(cli, ["convert", str(cuda_ckpt), str(tmp_path / "two"), *args, "--workers", "2"])
    assert r.exit_code == 0, r.output
    m = open_checkpoint(str(tmp_path / "two")).manifest
    assert {f.rank for f in m.files.values()} == {0, 1}
    _same(tmp_path / "one", tmp_path / "two")


def _rank_convert(rank: int, world: int, src: str, dst: str) -> None:
    from ckpt.converters.convert import ConvertOptions, convert

    assert os.environ["WORLD_SIZE"] == str(world)
    convert(src, dst, ConvertOptions.neuron(tp=2, qkv_linear=True))


def test_torchrun_ranks_share_and_commit(cuda_ckpt: Path, tmp_path: Path) -> None:
    run_ranks(_rank_convert, 3, str(cuda_ckpt), str(tmp_path / "multi"))
    m = open_checkpoint(str(tmp_path / "multi")).manifest
    assert {f.rank for f in m.files.values()} == {0, 1, 2}
    r = CliRunner().invoke(
        cli, ["convert", str(cuda_ckpt), str(tmp_path / "one"), "--to", "neuron", "--tp", "2", "--qkv-linear"]
    )
    assert r.exit_code == 0
    _same(tmp_path / "one", tmp_path / "multi")
    torch.testing.assert_close(torch.tensor(1.0), torch.tensor(1.0))
