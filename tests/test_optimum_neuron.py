"""optimum-neuron ``checkpoint-N/`` folders (``NeuronTrainer``): the whole folder converts, and is written back.

The folders are built by ``fixtures/optimum_neuron/build.py`` from NxD's own training tags (``save_checkpoint``,
the call optimum-neuron's ``save_pretrained`` makes, tag ``shards``) and the Trainer files at the root, as
optimum-neuron's sources write them (fixtures/optimum_neuron/README.md).  Ground truth: the tiny Llama the NxD run
trained (``fixtures/nxd/llama_gqa_h64``: weights, full AdamW state, scheduler).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_one_error, ckpt_cli
from safetensors.torch import load_file

import ckpt

ROOT = Path(__file__).resolve().parent.parent
TRUTH = ROOT / "fixtures" / "nxd" / "llama_gqa_h64"
sys.path.insert(0, str(ROOT / "fixtures" / "optimum_neuron"))
import build as on_build  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("optimum")
    return {v: on_build.build(base / v, v) for v in on_build.VARIANTS}


def ok(*args: object) -> str:
    r = ckpt_cli("convert", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr


def hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_truth_weights(folder: Path) -> None:
    want, got = load_file(TRUTH / "model.safetensors"), hf_weights(folder)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def assert_truth_optimizer(folder: Path) -> None:
    """``optimizer.pt`` of a Trainer folder holds the run's AdamW moments, in the Trainer's numbering."""
    from ckpt.converters.hf_trainer import trainer_param_groups

    opt = torch.load(folder / "optimizer.pt", weights_only=True)
    full = load_file(TRUTH / "optimizer_full.safetensors")
    decay, rest = trainer_param_groups(json.loads((TRUTH / "config.json").read_text()), "test")
    assert len(opt["state"]) == len(decay + rest) == len(full) // 3
    for i, name in enumerate(decay + rest):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt["state"][i][key], full[f"{name}.{key}"]), (name, key)


@pytest.mark.parametrize("variant", ["plain", "xser"])
def test_the_folder_converts_to_hf_equal_to_the_trained_weights(
    folders: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    """The new user's command, on the folder itself (it used to say 'holds 1 NxD tag (shards), not one')."""
    ok(folders[variant], tmp_path / "hf", "--from", "neuron", "--to", "cuda", "--format", "hf")
    assert_truth_weights(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"


def test_to_hf_trainer_carries_optimizer_scheduler_rng_and_step(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    src, out = folders["xser"], tmp_path / "checkpoint-3"
    said = ok(src, out, "--to", "cuda", "--format", "hf-trainer")
    assert "optimizer" not in " ".join(ln for ln in said.splitlines() if "not written" in ln), said
    assert_truth_weights(out)
    assert_truth_optimizer(out)
    # the run's one group (weight decay 0.01 on every tensor) keeps its hyper-parameters in both Trainer groups
    opt = torch.load(out / "optimizer.pt", weights_only=True)
    assert [g["weight_decay"] for g in opt["param_groups"]] == [0.01, 0.01]
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
    sched = torch.load(out / "scheduler.pt", weights_only=True)
    assert sched["last_epoch"] == 3 and sched["_last_lr"] == torch.load(src / "scheduler.pt")["_last_lr"]
    for r in range(4):
        a = torch.load(src / f"rng_state_{r}.pth", weights_only=False)
        b = torch.load(out / f"rng_state_{r}.pth", weights_only=False)
        assert torch.equal(a["cpu"], b["cpu"]) and a["python"] == b["python"] and a["xla"] == b["xla"]


def test_the_step_comes_from_the_files_not_the_folder_name(folders: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "checkpoint-77"
    shutil.copytree(folders["plain"], src)
    ok(src, tmp_path / "a", "--to", "cuda", "--format", "ckpt")
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["step"] == 3
    (src / "trainer_state.json").unlink()  # the scheduler's count of steps is the next witness
    ok(src, tmp_path / "b", "--to", "cuda", "--format", "ckpt")
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["step"] == 3
    (src / "scheduler.pt").unlink()
    assert_one_error(ckpt_cli("convert", src, tmp_path / "c", "--to", "cuda"), "records the step", "--step")
    assert not (tmp_path / "c").exists()


def test_disagreeing_step_files_are_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "checkpoint-3"
    shutil.copytree(folders["plain"], src)
    state = json.loads((src / "trainer_state.json").read_text())
    (src / "trainer_state.json").write_text(json.dumps({**state, "global_step": 4}))
    assert_one_error(
        ckpt_cli("convert", src, tmp_path / "o", "--to", "cuda"), "global_step 4", "last_epoch 3"
    )


def test_zero1_state_nxd_saved_for_dp_rank_0_only_is_refused_naming_it(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """optimum-neuron's wrapped ZeRO-1 optimizer: NxD saved DP rank 0's shards only.  Never read as if complete."""
    for fmt in ("hf-trainer", "ckpt"):
        r = ckpt_cli("convert", folders["zero1_hidden"], tmp_path / "o", "--to", "cuda", "--format", fmt)
        assert_one_error(
            r, "dp_rank_00_tp_rank_00_pp_rank_00.pt", "4096 of the 8192", "DP rank 0's shard only"
        )
        assert not (tmp_path / "o").exists()
    # a Hugging Face folder holds no optimizer: the weights convert (as consolidate would), and the cause is said
    said = ok(folders["zero1_hidden"], tmp_path / "hf", "--to", "cuda", "--format", "hf")
    assert "DP rank 0's shard only" in said and "weights only" in said
    assert_truth_weights(tmp_path / "hf")


def test_round_trip_through_our_format_back_to_an_optimum_neuron_folder(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    src = folders["plain"]
    ok(src, tmp_path / "ck", "--to", "cuda", "--format", "ckpt")
    back = tmp_path / "checkpoint-3"
    ok(tmp_path / "ck", back, "--to", "neuron", "--format", "optimum-neuron", "--tp", "2", "--dp", "2")
    assert (back / "shards" / "done").is_file() and (back / "shards" / "checkpoint").is_file()
    # NeuronTrainer's files at the root, none in the tag (save_pretrained passes NxD no scheduler/user content)
    assert (
        not (back / "shards" / "scheduler.pt").exists() and not (back / "shards" / "user_content.pt").exists()
    )
    assert json.loads((back / "trainer_state.json").read_text())["global_step"] == 3
    trn = json.loads((back / "trn_config.json").read_text())
    # a CUDA-layout source records no NxD form: TrainingNeuronConfig's default, xser
    assert trn["tensor_parallel_size"] == 2 and trn["use_xser"] is True
    assert any(p.name.endswith(".tensors") for p in (back / "shards" / "model").iterdir())
    assert sorted(p.name for p in back.glob("rng_state_*.pth")) == [f"rng_state_{r}.pth" for r in range(4)]
    # the layout optimum-neuron's LlamaForCausalLM builds at TP 2 over 2 KV heads: separate q/k/v projections
    # (the NxD run it came from used GQAQKVColumnParallelLinear), so the tags compare as checkpoints, optimizer too
    from ckpt.converters.nxd import read_tag

    b = read_tag(back / "shards")
    assert all("model.layers.0.self_attn.k_proj.weight" in t for t in b.per_rank_model.values())
    res = ckpt.diff(str(src), str(back))
    assert res.same and all(t.equal for t in res.tensors) and res.optimizer == "compared"
    ok(back, tmp_path / "hf", "--to", "cuda", "--format", "hf")
    assert_truth_weights(tmp_path / "hf")
    ok(back, tmp_path / "ck2", "--to", "cuda", "--format", "ckpt")
    m1 = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    m2 = json.loads((tmp_path / "ck2" / "manifest.json").read_text())
    assert m1["step"] == m2["step"] == 3 and m1["scheduler"] == m2["scheduler"] and m1["rng"] == m2["rng"]


def test_an_existing_dst_and_the_source_are_left_alone(folders: dict[str, Path], tmp_path: Path) -> None:
    before = sorted(p.relative_to(folders["plain"]) for p in folders["plain"].rglob("*"))
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep").write_text("x")
    r = ckpt_cli(
        "convert", folders["plain"], tmp_path / "dst", "--to", "neuron", "--format", "optimum-neuron"
    )
    assert r.returncode != 0 and (tmp_path / "dst" / "keep").read_text() == "x"
    assert sorted(p.relative_to(folders["plain"]) for p in folders["plain"].rglob("*")) == before


def test_tp_pp_folder_written_by_workers_reads_back_to_the_truth(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """TP 2 x PP 2, xser, ranks shared by two worker processes: weights and AdamW moments come back exact."""
    trn = tmp_path / "checkpoint-3"
    ok(folders["xser"], trn, "--to", "neuron", "--format", "optimum-neuron", "--tp", "2", "--pp", "2", "--dp", "1",
       "--workers", "2")  # fmt: skip
    assert sorted(p.name for p in (trn / "shards" / "model").glob("*_pp_rank_0?.pt")) == [
        f"dp_rank_00_tp_rank_0{t}_pp_rank_0{p}.pt" for t in range(2) for p in range(2)
    ]
    trn_cfg = json.loads((trn / "trn_config.json").read_text())
    assert (trn_cfg["pipeline_parallel_size"], trn_cfg["use_xser"]) == (2, True)
    out = tmp_path / "gpu"
    ok(trn, out, "--to", "cuda", "--format", "hf-trainer")
    assert_truth_weights(out)
    assert_truth_optimizer(out)


def test_a_lora_run_converts_to_the_peft_adapter_exactly(tmp_path: Path) -> None:
    """adapter_default/adapter_shards (fused qkv / gate_up LoRA names, TP 2) -> the PEFT folder it was trained as."""
    lora = ROOT / "fixtures" / "nxd_lora"
    ck = on_build.build_lora(tmp_path / "run")
    cfg = lora / "base" / "config.json"
    ok(ck, tmp_path / "peft", "--to", "cuda", "--format", "peft", "--config", cfg)
    want = load_file(lora / "adapter" / "adapter_model.safetensors")
    got = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    peft_cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (peft_cfg["r"], peft_cfg["lora_alpha"]) == (4, 8)
    # without the base config its shapes cannot be read: one line, nothing written
    assert_one_error(ckpt_cli("convert", ck, tmp_path / "o", "--to", "cuda", "--format", "peft"), "--config")
    assert not (tmp_path / "o").exists()


def test_zero1_state_of_one_dp_rank_that_covers_every_parameter_is_read(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """A wrapped ZeRO-1 optimizer at DP 1: NxD saves the one DP rank's ZeRO-1 dict, which is the whole state."""
    from ckpt.converters.convert import ConvertOptions, convert
    from ckpt.converters.nxd.xser import load_nxd_file
    from ckpt.converters.nxd.zero1 import is_zero1_dict

    trn = tmp_path / "checkpoint-3"
    convert(
        str(folders["plain"]),
        str(trn),
        ConvertOptions.neuron(format="optimum-neuron", tp=2, dp=1, zero1=True),
    )
    opt0 = load_nxd_file(trn / "shards" / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", True, mmap=True)
    assert is_zero1_dict(opt0) and not list((trn / "shards" / "optim").glob("dp_rank_01_*"))
    ok(trn, tmp_path / "gpu", "--to", "cuda", "--format", "hf-trainer")
    assert_truth_weights(tmp_path / "gpu")
    assert_truth_optimizer(tmp_path / "gpu")


def test_an_nxd_tag_written_as_a_folder_says_what_the_folder_cannot_hold(tmp_path: Path) -> None:
    """NxD's own tag (user_content.pt, scheduler.pt inside) -> optimum-neuron: the scheduler moves to the root, the
    user content is named as not written, and the step is the tag's."""
    tag = TRUTH / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
    r = ckpt_cli("convert", tag, tmp_path / "checkpoint-3", "--to", "neuron", "--format", "optimum-neuron",
                 "--config", TRUTH / "config.json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "not written" in r.stderr and "user metadata" in r.stderr, r.stderr
    out = tmp_path / "checkpoint-3"
    assert torch.load(out / "scheduler.pt", weights_only=True) == torch.load(
        tag / "scheduler.pt", weights_only=True
    )
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
