"""The ckpt command as a user runs it (a real subprocess): ls, inspect, verify, and errors on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ckpt
from ckpt.manifest import seal


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
