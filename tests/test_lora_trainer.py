"""PEFT LoRA Trainer folders (issue 37, item 3): a real ``transformers.Trainer`` training a ``peft.get_peft_model``
LoRA (``examples/hf_trainer.py --lora``, a tiny Llama on CPU) writes ``checkpoint-N/`` folders; ckpt lists them with
their step, inspects, verifies, converts them with step, optimizer moments, scheduler and RNG (to ckpt, to an NxD
LoRA tag, and back to a Trainer folder the Trainer resumes bit for bit), and diffs them equal to their conversions.

One Trainer run is shared by every test (module fixture); each resume is one more short run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from ckpt.cli.main import cli
from click.testing import CliRunner
from test_integration_transformers import losses, train

pytest.importorskip("peft")
STEPS, EVERY = 6, 2


def run(*args: object) -> object:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora_trainer") / "out"
    assert train(out, "--lora", "--steps", STEPS, "--save-every", EVERY) == 0
    assert (out / "checkpoint-2" / "optimizer.pt").is_file() and not (
        out / "checkpoint-2" / "config.json"
    ).exists()
    return out


@pytest.fixture(scope="module")
def config(straight: Path) -> Path:
    """The base model's config.json (NxD needs it to lay the adapter out)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from hf_trainer import tiny_llama

    path = straight.parent / "config.json"
    tiny_llama().config.to_json_file(str(path))
    return path


def test_ls_inspect_verify_see_the_folders_with_their_step(straight: Path) -> None:
    res = run("ls", straight)
    assert res.exit_code == 0, res.output
    rows = [ln.split() for ln in res.output.splitlines() if "checkpoint-" in ln]
    assert [(r[0], r[1], r[-1]) for r in rows] == [(str(s), f"checkpoint-{s}", "ok") for s in (2, 4, 6)], (
        res.output
    )
    res = run("inspect", straight / "checkpoint-4", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["step"] == 4 and doc["format"] == "hf-trainer-lora"
    roles = [t["role"] for t in doc["tensors"].values()]
    assert (
        roles.count("parameter") == 28 and roles.count("optimizer_state") == 56
    )  # exp_avg + exp_avg_sq each
    res = run("verify", straight / "checkpoint-4")
    assert res.exit_code == 0 and "ok" in res.output, res.output


def test_convert_to_ckpt_keeps_step_moments_scheduler_rng_and_diffs_equal(
    straight: Path, tmp_path: Path
) -> None:
    import ckpt

    src, dst = straight / "checkpoint-4", tmp_path / "ck"
    res = run("convert", src, dst, "--to", "cuda", "--format", "ckpt")  # no --step: trainer_state.json says 4
    assert res.exit_code == 0 and "not written" not in res.output, res.output
    m = ckpt.open_checkpoint(str(dst)).manifest
    assert (
        m.step == 4 and m.scheduler is not None and m.rng and m.extra["hf_trainer_state"]["global_step"] == 4
    )
    assert sum(t.role == "optimizer_state" for t in m.tensors.values()) == 56
    res = run("diff", src, dst)
    assert res.exit_code == 0 and "84 equal" in res.output and "only in" in res.output, res.output
    assert ", 0 only in A, 0 only in B" in res.output
    res = run("diff", straight / "checkpoint-2", dst)
    assert res.exit_code == 1 and "step: 2 -> 4" in res.output, res.output


def test_convert_to_nxd_zero1_shards_hold_the_adam_moments_and_names_what_it_cannot(
    straight: Path, config: Path, tmp_path: Path
) -> None:
    """TP 2 x DP 2: one ZeRO-1 file per (dp, tp) rank, each holding its DP shard of every LoRA parameter's Adam
    moments; merged back they are the Trainer's moments bit for bit (``ckpt diff`` through NxD's layout)."""
    src, tag = straight / "checkpoint-4", tmp_path / "tag"
    to = ["--to", "neuron", "--format", "nxd", "--tp", 2, "--dp", 2, "--config", config]
    res = run("convert", src, tag, *to)  # no --step: user_content.pt gets global_step
    assert res.exit_code == 0, res.output
    assert "not written: RNG state (an NxD LoRA tag cannot hold them)" in res.output
    files = sorted(p.name for p in (tag / "optim").iterdir())
    assert files == [f"dp_rank_0{d}_tp_rank_0{t}_pp_rank_00.pt" for d in (0, 1) for t in (0, 1)]
    for name in files:
        z = torch.load(tag / "optim" / name)
        assert sorted(z["shape_info"]) == sorted(z["base_state"]) and z["param_groups"][0]["param_names"]
        for pid, per in z["base_state"].items():
            rows = -(-z["shape_info"][pid][0] // 2)  # dim 0 padded to a multiple of dp, then halved
            assert per["exp_avg"].shape[0] == per["exp_avg_sq"].shape[0] == rows and int(per["step"]) == 4
    assert torch.load(tag / "scheduler.pt") == torch.load(src / "scheduler.pt")
    assert torch.load(tag / "user_content.pt")["total_steps"] == 4
    res = run(
        "diff", src, tag, "--config", config
    )  # adapter and moments, through NxD's fused, widened layout
    assert res.exit_code == 0 and "84 equal" in res.output, res.output


def test_to_a_plain_peft_folder_names_what_is_left_out(straight: Path, tmp_path: Path) -> None:
    res = run("convert", straight / "checkpoint-2", tmp_path / "p", "--to", "cuda", "--format", "peft")
    assert res.exit_code == 0, res.output
    line = "not written: optimizer state, scheduler, RNG state, trainer_state.json (a PEFT adapter folder cannot hold them)"
    assert line in res.output


@pytest.mark.parametrize("route", ["ckpt", "nxd"])
def test_back_to_a_trainer_folder_resumes_bit_for_bit(
    straight: Path, config: Path, tmp_path: Path, route: str
) -> None:
    """checkpoint-2 -> ckpt (or an NxD LoRA tag) -> a Trainer folder: the Trainer resumes from it and its losses
    and its checkpoint-6 (adapter and Adam moments) are the uninterrupted run's, bit for bit."""
    mid, back = tmp_path / "mid", tmp_path / "checkpoint-2"
    to = (
        ["--to", "cuda", "--format", "ckpt"]
        if route == "ckpt"
        else ["--to", "neuron", "--format", "nxd", "--config", config]
    )
    assert run("convert", straight / "checkpoint-2", mid, *to).exit_code == 0
    res = run("convert", mid, back, "--to", "cuda", "--format", "hf-trainer", "--config", config)
    assert res.exit_code == 0, res.output
    a = torch.load(straight / "checkpoint-2" / "optimizer.pt")
    b = torch.load(back / "optimizer.pt")
    assert a["param_groups"] == b["param_groups"]
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    out = tmp_path / "out"
    assert train(out, "--lora", "--steps", STEPS, "--save-every", EVERY, "--resume", back) == 0
    want = losses(straight)
    assert losses(out) == {s: want[s] for s in range(3, STEPS + 1)}
    res = run("diff", straight / f"checkpoint-{STEPS}", out / f"checkpoint-{STEPS}")
    assert res.exit_code == 0 and "84 equal" in res.output, res.output


def test_an_optimizer_of_another_grouping_is_refused_in_one_line(straight: Path, tmp_path: Path) -> None:
    src = tmp_path / "checkpoint-2"
    shutil.copytree(straight / "checkpoint-2", src)
    opt = torch.load(src / "optimizer.pt")
    g0, g1 = opt["param_groups"]
    g0["params"], g1["params"] = g0["params"][:-1], [g0["params"][-1]]
    torch.save(opt, src / "optimizer.pt")
    res = run("convert", src, tmp_path / "dst", "--to", "cuda", "--format", "ckpt")
    assert res.exit_code == 2 and "param_groups of [27, 1] parameters" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "dst").exists()
