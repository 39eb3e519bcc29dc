"""NxD Training (``neuronx-distributed-training``) tags: read, written, and resumed by an HF Trainer.

The fixture (``fixtures/nxdt/llama_gqa_h64``, README there) is a tag as NxD Training writes it: Lightning's own
checkpoint dict (minus model and optimizer) in ``user_content.pt``, no ``scheduler.pt``, and Lightning's
``ModelCheckpoint`` name from NxD Training's template, over NxD's own rank files of the ground-truth state in
``fixtures/nxd/llama_gqa_h64``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from ckpt.cli.main import cli
from ckpt.converters.nxd.training import TagName, parse_tag_name
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from ckpt.errors import CkptError

ROOT = Path(__file__).resolve().parents[1]
TRUTH = ROOT / "fixtures" / "nxd" / "llama_gqa_h64"
CONFIG = TRUTH / "config.json"
FIX = ROOT / "fixtures" / "nxdt" / "llama_gqa_h64"
FACTS = json.loads((FIX / "facts.json").read_text())
TAG = FIX / "checkpoints" / FACTS["tag"]


def run(*args: object, code: int = 0) -> str:
    res = CliRunner().invoke(cli, ["convert", *map(str, args)], terminal_width=400)
    assert res.exit_code == code, res.output
    return res.output


def _truth_equal(folder: Path) -> None:
    want = load_file(TRUTH / "model.safetensors")
    got: dict[str, torch.Tensor] = {}
    for f in folder.glob("*.safetensors"):
        got.update(load_file(f))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


# ---------------------------------------------------------------------------------------------- tag names
def test_tag_name_template_is_read_and_nothing_else() -> None:
    assert parse_tag_name("hf_llama3_8B--step=10-consumed_samples=1280.0.ckpt") == TagName(
        "hf_llama3_8B", 10, 1280, False
    )
    assert parse_tag_name(FACTS["last_tag_name"]) == TagName("llama_gqa_h64", 3, 12, True)
    for other in ("step_3", "hf_llama--step=3.ckpt", "run-12.0", "a--step=3-consumed_samples=12.0", "x.ckpt"):
        assert parse_tag_name(other) is None, other
    with pytest.raises(CkptError, match="not a whole number"):
        parse_tag_name("a--step=3-consumed_samples=12.5.ckpt")


@given(
    run=st.from_regex(r"[A-Za-z0-9_.]{1,12}", fullmatch=True),
    step=st.integers(0, 10**9),
    samples=st.integers(0, 10**15),
    last=st.booleans(),
)
def test_tag_name_round_trips(run: str, step: int, samples: int, last: bool) -> None:
    name = TagName(run, step, samples, last)
    assert parse_tag_name(str(name)) == name


# ---------------------------------------------------------------------------------------------- as a source
def test_tag_converts_with_step_scheduler_and_data_position_and_no_warning(tmp_path: Path) -> None:
    ck, hf = tmp_path / "ck", tmp_path / "checkpoint-3"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "sources disagree on the step"
        said = run(TAG, ck, "--to", "cuda", "--format", "ckpt", "--config", CONFIG)
    assert "disagree" not in said
    m = json.loads((ck / "manifest.json").read_text())
    assert m["step"] == 3 and m["progress"] == {"step": 3, "samples": 12}
    pos = m["data_position"]
    assert (pos["adapter"], pos["samples"], pos["global_batch"], pos["prefix"], pos["dp"]) == (
        "nxdt",
        12,
        4,
        True,
        2,
    )
    assert m["scheduler"] is not None and m["extra"]["nxdt"]["run"] == "llama_gqa_h64"

    run(TAG, hf, "--to", "cuda", "--format", "hf-trainer", "--config", CONFIG)
    _truth_equal(hf)
    state = json.loads((hf / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["train_batch_size"] == 4
    sched = torch.load(hf / "scheduler.pt", weights_only=True)
    assert {k: sched[k] for k in json.loads((TRUTH / "scheduler.json").read_text())} == json.loads(
        (TRUTH / "scheduler.json").read_text()
    )
    opt = torch.load(hf / "optimizer.pt", weights_only=True)
    full = load_file(TRUTH / "optimizer_full.safetensors")
    from ckpt.converters.hf_trainer import trainer_param_groups

    order = trainer_param_groups(json.loads(CONFIG.read_text()), "test")
    by_name = {
        n: opt["state"][i]
        for g, ns in zip(opt["param_groups"], order, strict=True)
        for i, n in zip(g["params"], ns, strict=True)
    }
    assert len(by_name) == 39
    for n, per in by_name.items():
        assert torch.equal(per["exp_avg"], full[f"{n}.exp_avg"]) and float(per["step"]) == 3.0


def test_last_tag_reads_the_same(tmp_path: Path) -> None:
    last = tmp_path / FACTS["last_tag_name"]
    shutil.copytree(TAG, last)
    run(last, tmp_path / "ck", "--to", "cuda", "--format", "ckpt", "--config", CONFIG)
    m = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert m["step"] == 3 and m["data_position"]["samples"] == 12 and m["extra"]["nxdt"]["last"] is True


def test_step_records_that_disagree_are_refused(tmp_path: Path) -> None:
    src = tmp_path / FACTS["tag"]
    shutil.copytree(TAG, src)
    user = torch.load(src / "user_content.pt", weights_only=True)
    torch.save({**user, "global_step": 4}, src / "user_content.pt")
    out = run(src, tmp_path / "ck", "--to", "cuda", "--format", "ckpt", code=2)
    assert "global_step=4, tag name step=3" in out and "--step" in out and not (tmp_path / "ck").exists()
    run(src, tmp_path / "ck", "--to", "cuda", "--format", "ckpt", "--step", "3", "--config", CONFIG)


def test_megatron_style_names_are_refused_in_one_line(tmp_path: Path) -> None:
    src = tmp_path / FACTS["tag"]
    shutil.copytree(TAG, src)
    for f in (src / "model").iterdir():
        sd = torch.load(f, weights_only=True)
        torch.save(
            {k.replace("model.layers.", "language_model.encoder.layers."): v for k, v in sd.items()}, f
        )
    out = run(src, tmp_path / "ck", "--to", "cuda", "--format", "ckpt", code=2)
    assert "language_model.encoder.layers.0" in out and "Megatron-style NxD Training checkpoints" in out
    assert len(out.strip().splitlines()) == 1


def test_omegaconf_objects_in_the_lightning_dict_are_refused_not_unpickled(tmp_path: Path) -> None:
    src = tmp_path / FACTS["tag"]
    shutil.copytree(TAG, src)
    mod = types.ModuleType("omegaconf.dictconfig")

    class DictConfig(dict):
        pass

    DictConfig.__module__, DictConfig.__qualname__ = "omegaconf.dictconfig", "DictConfig"
    mod.DictConfig = DictConfig
    pkg = types.ModuleType("omegaconf")
    pkg.dictconfig = mod
    sys.modules.update({"omegaconf": pkg, "omegaconf.dictconfig": mod})  # omegaconf is not installed here
    try:
        user = torch.load(src / "user_content.pt", weights_only=True)
        torch.save({**user, "hyper_parameters": DictConfig(cfg={})}, src / "user_content.pt")
    finally:
        del sys.modules["omegaconf.dictconfig"], sys.modules["omegaconf"]
    out = run(src, tmp_path / "ck", "--to", "cuda", "--format", "ckpt", code=2)
    assert "omegaconf.dictconfig.DictConfig" in out and "NLPCheckpointIO" in out


# ---------------------------------------------------------------------------------------------- as a target
def test_written_tag_round_trips_with_a_plain_lightning_dict(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    run(TAG, ck, "--to", "cuda", "--format", "ckpt", "--config", CONFIG)
    bad = tmp_path / "checkpoints" / "step_3"
    out = run(ck, bad, "--to", "neuron", "--format", "nxdt", "--tp", "2", "--qkv-linear", code=2)
    assert "consumed_samples=12.0.ckpt" in out and not bad.exists()
    wrong = tmp_path / "checkpoints" / "run--step=3-consumed_samples=16.0.ckpt"
    assert "consumed_samples=16" in run(ck, wrong, "--to", "neuron", "--format", "nxdt", "--tp", "2", code=2)
    tag = tmp_path / "checkpoints" / "run--step=3-consumed_samples=12.0.ckpt"
    run(ck, tag, "--to", "neuron", "--format", "nxdt", "--tp", "2", "--dp", "2", "--qkv-linear")
    assert not (tag / "scheduler.pt").exists() and (tag / "done").is_file()
    user = torch.load(tag / "user_content.pt", weights_only=True)  # plain types and tensors only
    original = torch.load(TAG / "user_content.pt", weights_only=True)
    assert user["global_step"] == 3 and user["lr_schedulers"] == original["lr_schedulers"]
    assert user["loops"] == original["loops"]
    back = tmp_path / "back"
    run(tag, back, "--to", "cuda", "--format", "hf", "--config", CONFIG)
    _truth_equal(back)
    m2 = tmp_path / "ck2"
    run(tag, m2, "--to", "cuda", "--format", "ckpt", "--config", CONFIG)
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (ck, m2))
    assert (a["step"], a["scheduler"], a["data_position"]) == (b["step"], b["scheduler"], b["data_position"])


def test_source_without_data_position_needs_consumed_samples(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    run(TAG, hf, "--to", "cuda", "--format", "hf", "--config", CONFIG)
    tag = tmp_path / "c" / "run--step=7-consumed_samples=28.0.ckpt"
    out = run(hf, tag, "--to", "neuron", "--format", "nxdt", "--tp", "2", "--step", "7", code=2)
    assert "--consumed-samples" in out and not tag.exists()
    run(hf, tag, "--to", "neuron", "--format", "nxdt", "--tp", "2", "--step", "7", "--consumed-samples", "28")
    user = torch.load(tag / "user_content.pt", weights_only=True)
    assert user == {"epoch": 0, "global_step": 7}  # no scheduler in an HF folder: none claimed


# ------------------------------------------------------------------------------- HF Trainer continues the run
SCRIPT = ROOT / "examples" / "hf_trainer.py"
STEPS = 14


def _train(out: Path, *args: object) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "USE_TORCH_XLA": "0", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--steps", str(STEPS), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _losses(out: Path) -> dict[int, float]:
    from ckpt.resume.sources import read_jsonl

    return {r.step: r.loss for s in read_jsonl(out / "ledger.jsonl").sessions for r in s.steps}


def test_trainer_resumed_from_an_nxdt_tag_continues_the_run(tmp_path: Path) -> None:
    """The CPU run's checkpoint-10 -> an NxD Training tag (TP=2, ZeRO-1 over 2, NxD names, step and
    consumed_samples in its name) -> an HF Trainer folder: the Trainer resumed from it logs the uninterrupted run's
    losses for steps 11.., bit for bit."""
    pytest.importorskip("accelerate")
    straight = tmp_path / "straight"
    _train(straight)
    ck10 = straight / "checkpoint-10"
    tag = tmp_path / "checkpoints" / "tiny--step=10-consumed_samples=80.0.ckpt"
    run(ck10, tag, "--to", "neuron", "--format", "nxdt", "--tp", "2", "--dp", "2", "--qkv-linear",
        "--consumed-samples", "80")  # fmt: skip
    back = tmp_path / "checkpoint-10"
    run(tag, back, "--to", "cuda", "--format", "hf-trainer", "--config", ck10 / "config.json")
    state = json.loads((back / "trainer_state.json").read_text())
    assert state["global_step"] == 10 and state["train_batch_size"] == 8
    out = tmp_path / "out"
    shutil.copytree(straight, out)
    _train(out, "--resume", back)
    want = _losses(straight)
    got = {s: v for s, v in _losses(out).items() if s > 10}
    assert got == {s: want[s] for s in range(11, STEPS + 1)}


# ------------------------------------------------------------------ NxD Training's load path takes the written tag
def _lightning_resume(tag: Path, hf: Path, ck: Path) -> dict:
    """Resume real Lightning from ``tag`` the way NxD Training does: a CheckpointIO that follows
    ``NLPCheckpointIO.load_checkpoint`` (nlp_overrides.py:547-570: the user content NxD's ``load_checkpoint`` returns,
    ``state_dict`` / ``optimizer_states`` put back, ``ptl_version`` 2.5.0 as examples/training.py:46-49 passes it).
    NxD's own rank loading is stood in for by ckpt's conversions of the same tag (to HF names, and ``ckpt.restore``
    into the optimizer Lightning builds)."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import CheckpointIO
    from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

    from ckpt.restoring.loader import restore

    cfg = json.loads(CONFIG.read_text())
    hp = json.loads((TRUTH / "truth.json").read_text())["training"]
    seen: dict = {"steps": [], "lrs": [], "losses": [], "moment_steps": []}

    def optimizer_of(model: torch.nn.Module):
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=hp["lr"],
            betas=tuple(hp["betas"]),
            eps=hp["eps"],
            weight_decay=hp["weight_decay"],
        )
        return opt, get_cosine_schedule_with_warmup(opt, hp["num_warmup_steps"], hp["num_training_steps"])

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(LlamaConfig(**cfg)).float()

        def state_dict(self, *a, **k):
            return self.model.state_dict(*a, **k)

        def load_state_dict(self, sd, strict=True):
            return self.model.load_state_dict(sd, strict=strict)

        def training_step(self, batch, batch_idx):
            opt = self.optimizers().optimizer
            seen["steps"].append(self.trainer.global_step)
            seen["lrs"].append(opt.param_groups[0]["lr"])
            seen["moment_steps"].append(float(opt.state[next(iter(self.model.parameters()))]["step"]))
            loss = self.model(input_ids=batch, labels=batch).loss
            seen["losses"].append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            opt, sched = optimizer_of(self.model)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class NxdtLoad(CheckpointIO):
        def load_checkpoint(self, path, map_location=None, weights_only=None):
            checkpoint = torch.load(Path(path) / "user_content.pt", weights_only=False)  # NxD's load_object
            if checkpoint is None:
                checkpoint = {}
            checkpoint["state_dict"] = load_file(hf / "model-00001-of-00001.safetensors")
            checkpoint.setdefault("pytorch-lightning_version", "2.5.0")
            model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
            opt, _ = optimizer_of(model)
            restore(str(ck), model=model, optimizer=opt, rng=False)
            checkpoint["optimizer_states"] = [opt.state_dict()]
            return checkpoint

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            pass

        def remove_checkpoint(self, path):
            pass

    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    def restore_loops(
        self,
    ) -> None:  # NLPCheckpointConnector.restore_loops, nlp_overrides.py:643-677 (fitting)
        if not self._loaded_checkpoint:
            return
        fit_loop = self.trainer.fit_loop
        fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = (
            self._loaded_checkpoint.get("global_step", 0)
        )
        fit_loop.epoch_progress.current.completed = self._loaded_checkpoint.get("epoch", 0)
        loops = self._loaded_checkpoint.get("loops")
        if loops is not None:
            fit_loop.load_state_dict(loops["fit_loop"])

    gen = torch.Generator().manual_seed(99)
    batches = [torch.randint(0, cfg["vocab_size"], (4, 32), generator=gen) for _ in range(3)]
    module = Module()
    trainer = pl.Trainer(
        max_steps=6, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, plugins=[NxdtLoad()],
    )  # fmt: skip
    plain = _CheckpointConnector.restore_loops
    _CheckpointConnector.restore_loops = restore_loops  # NxD Training's NLPTrainer uses its own connector
    try:
        trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=str(tag))
    finally:
        _CheckpointConnector.restore_loops = plain
    truth_model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
    truth_model.load_state_dict(load_file(TRUTH / "model.safetensors"))
    with torch.no_grad():
        seen["first_loss_truth"] = float(truth_model(input_ids=batches[0], labels=batches[0]).loss)
    seen["final_step"] = trainer.global_step
    return seen


@pytest.mark.parametrize("dict_from", ["nxdt", "nxd"])
def test_lightning_resumes_from_the_written_tag(tmp_path: Path, dict_from: str) -> None:
    """The written ``user_content.pt`` is what NxD Training's restore reads: Lightning resumes at step 3 with the
    scheduler after 3 steps (the truth's lr for step 4) and AdamW's moments, whether the Lightning dict is carried
    from an NxD Training tag or made for a plain NxD tag (``user_content`` without Lightning keys)."""
    pytest.importorskip("lightning")
    src = TAG if dict_from == "nxdt" else TRUTH / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
    tag = tmp_path / "checkpoints" / "run--step=3-consumed_samples=12.0.ckpt"
    run(
        src,
        tag,
        "--to",
        "neuron",
        "--format",
        "nxdt",
        "--dp",
        "2",
        "--consumed-samples",
        "12",
        "--config",
        CONFIG,
    )
    user = torch.load(tag / "user_content.pt", weights_only=True)
    assert ("loops" in user) == (dict_from == "nxdt") and user["global_step"] == 3
    hf, ck = tmp_path / "hf", tmp_path / "ck"
    run(tag, hf, "--to", "cuda", "--format", "hf", "--config", CONFIG)
    run(tag, ck, "--to", "cuda", "--format", "ckpt", "--config", CONFIG)
    seen = _lightning_resume(tag, hf, ck)
    truth = json.loads((TRUTH / "truth.json").read_text())
    assert seen["steps"] == [3, 4, 5] and seen["final_step"] == 6
    assert seen["lrs"][0] == truth["lr_per_step"]["4"]
    assert seen["moment_steps"] == [3.0, 4.0, 5.0]
    assert seen["losses"][0] == seen["first_loss_truth"]  # the weights are the tag's


def test_xser_tag_reads_and_writes(tmp_path: Path) -> None:
    """NxD Training's configs save with xser (``exp_manager.save_xser: True``): the same tag with NxD's xser files."""
    src = tmp_path / FACTS["tag"]
    shutil.copytree(TRUTH / "nxd_train_tp2_dp2_zero1_xser" / "step_3", src)
    (src / "scheduler.pt").unlink()
    shutil.copy(TAG / "user_content.pt", src / "user_content.pt")
    hf = tmp_path / "hf"
    run(src, hf, "--to", "cuda", "--format", "hf-trainer", "--config", CONFIG)
    _truth_equal(hf)
    assert json.loads((hf / "trainer_state.json").read_text())["train_batch_size"] == 4
    tag = tmp_path / "out" / FACTS["tag"]
    run(src, tag, "--to", "neuron", "--format", "nxdt", "--xser", "--config", CONFIG)
    assert any(p.name.endswith(".tensors") for p in (tag / "model").iterdir())
    run(tag, tmp_path / "back", "--to", "cuda", "--format", "hf", "--config", CONFIG)
    _truth_equal(tmp_path / "back")


def test_contradicting_data_positions_are_refused(tmp_path: Path) -> None:
    out = run(TAG, tmp_path / "ck", "--to", "cuda", "--consumed-samples", "16", "--config", CONFIG, code=2)
    assert "records 12 consumed samples" in out and not (tmp_path / "ck").exists()
    hf = tmp_path / "checkpoint-3"
    run(TAG, hf, "--to", "cuda", "--format", "hf-trainer", "--config", CONFIG)  # train_batch_size 4
    out = run(
        hf, tmp_path / "again", "--to", "cuda", "--format", "hf-trainer", "--consumed-samples", "24", code=2
    )
    assert "8 samples per step" in out and "train_batch_size=4" in out and not (tmp_path / "again").exists()
    run(hf, tmp_path / "again", "--to", "cuda", "--format", "hf-trainer", "--consumed-samples", "12")


def test_plain_nxd_records_count_for_a_tag_named_by_the_template(tmp_path: Path) -> None:
    """A tag named by NxD Training's template but holding a plain NxD ``user_content`` and ``scheduler.pt``: their
    steps are records too (and must agree with the name); the name still gives the data position."""
    plain = (
        TRUTH / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
    )  # user_content total_steps=3, scheduler last_epoch=3
    wrong = tmp_path / "run--step=4-consumed_samples=16.0.ckpt"
    shutil.copytree(plain, wrong)
    out = run(wrong, tmp_path / "ck", "--to", "cuda", "--config", CONFIG, code=2)
    assert "total_steps=3" in out and "tag name step=4" in out
    right = tmp_path / "run--step=3-consumed_samples=12.0.ckpt"
    shutil.copytree(plain, right)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(right, tmp_path / "ck", "--to", "cuda", "--config", CONFIG)
    m = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert m["step"] == 3 and m["data_position"]["samples"] == 12 and m["scheduler"] is not None


def test_name_step_is_a_strict_parser() -> None:
    from ckpt.converters.nxd.training import name_step

    assert name_step(FACTS["tag"]) == 3 and name_step(FACTS["last_tag_name"]) == 3
    assert name_step("step_3") is None and name_step("a--step=3-consumed_samples=1.5.ckpt") is None


def test_fixture_is_what_lightning_writes(tmp_path: Path) -> None:
    """The committed tag's ``user_content.pt`` and name are remade by the generator with the installed Lightning:
    the same records (paths of the machine that made it and Lightning's version aside)."""
    pytest.importorskip("lightning")
    out = tmp_path / "fx"
    env = {**os.environ, "NXDT_FIXTURE_OUT": str(out), "USE_TORCH_XLA": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "fixtures" / "nxdt" / "make_fixture.py")], env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = torch.load(out / "checkpoints" / FACTS["tag"] / "user_content.pt", weights_only=True)
    have = torch.load(TAG / "user_content.pt", weights_only=True)
    skip = {"callbacks", "pytorch-lightning_version"}
    assert {k: v for k, v in made.items() if k not in skip} == {
        k: v for k, v in have.items() if k not in skip
    }
    (cb_made,), (cb_have,) = made["callbacks"].values(), have["callbacks"].values()
    assert set(cb_made) == set(cb_have) and cb_made["best_model_score"] == cb_have["best_model_score"] == 3
