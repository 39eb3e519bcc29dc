"""HF ``Trainer`` with ``CkptCallback`` for real: a tiny Llama on CPU, SIGKILLed, resumed, verified.

Every run is ``examples/hf_trainer.py`` in its own process (``USE_TORCH_XLA=0``, one thread,
``full_determinism``): an uninterrupted run, a run killed after step 12 (checkpoints every 5 steps, so
``checkpoint-10`` is the newest), and resumes of copies of it with ``resume_from_checkpoint=True``.
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
from ckpt.cli.main import cli
from click.testing import CliRunner

from ckpt.resume.checks import Cause, VerifyOptions
from ckpt.resume.hf_facts import TrainerCheckpointFacts
from ckpt.resume.sources import load_run, read_jsonl
from ckpt.resume.verify import verify_run

pytest.importorskip("accelerate")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "hf_trainer.py"
STEPS, KILL_AT = 20, 12


def train(out: Path, *args: object) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "USE_TORCH_XLA": "0", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--steps", str(STEPS), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"{cmd} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.returncode


def losses(out: Path) -> dict[int, float]:
    """The effective loss per step (the last session's value where a step was logged twice)."""
    run = read_jsonl(out / "ledger.jsonl")
    return {r.step: r.loss for s in run.sessions for r in s.steps}


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "out"
    assert train(out, "--save-state") == 0
    return out


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("crashed") / "out"
    assert train(out, "--kill-at", KILL_AT) == -signal.SIGKILL
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-5"]
    return out


def resumed(
    crashed: Path, dest: Path, delete: str | None = None, bug: str | None = None, *extra: str
) -> Path:
    out = dest / "out"
    shutil.copytree(crashed, out)
    if delete:
        (out / "checkpoint-10" / delete).unlink()
    assert train(out, "--resume", *(("--bug", bug) if bug else ()), *extra) == 0
    return out


@pytest.fixture(scope="module")
def data_reset(crashed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Resumed with ``ignore_data_skip=True``; ``trainer.save_state()`` after training, as HF's scripts do."""
    return resumed(crashed, tmp_path_factory.mktemp("data_reset"), None, "data_reset", "--save-state")


@pytest.fixture(scope="module")
def clean_resume(crashed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resumed(crashed, tmp_path_factory.mktemp("clean_resume"), None, None, "--save-state")


def test_callback_ledger_resume_verifies_and_continues_bit_for_bit(
    clean_resume: Path, straight: Path
) -> None:
    out = clean_resume
    run = read_jsonl(out / "ledger.jsonl")
    dead, post = run.sessions
    assert [s.step for s in dead.saves] == [5, 10] and dead.exit is None  # killed: no exit event
    (restore,) = post.restores
    assert restore.step == 10 and restore.path == str(out / "checkpoint-10")
    assert [s.step for s in post.saves] == [15, 20] and post.exit is not None
    assert dead.env["framework"] == "transformers.Trainer" and dead.env["deterministic"] is True
    assert [r.step for r in post.steps] == list(range(11, STEPS + 1))
    assert all(r.rng_digest and r.lr is not None and r.grad_norm is not None for r in post.steps)
    # batch digests and sample counts from the callback alone (the example's data code knows nothing of them)
    assert all(r.data_digest and r.samples == 8 * r.step for s in run.sessions for r in s.steps)
    assert restore.optimizer_step == 10
    assert losses(out) == losses(straight)  # the resume continued the uninterrupted run exactly
    res = CliRunner().invoke(cli, ["verify-resume", str(out), "--json"])
    assert res.exit_code == 0, res.output
    (b,) = json.loads(res.output)["boundaries"]
    checks = {c["check"]: c for c in b["checks"]}
    assert b["restored_step"] == 10 and checks["counters"]["status"] == "pass"
    assert checks["counters"]["numbers"]["scheduler_last_epoch"] == 10
    assert checks["loss"]["status"] == "pass" and checks["loss"]["basis"] == "overlap"
    assert checks["weights"]["status"] == "pass", checks["weights"]
    assert "weights after restore equal checkpoint-10's" in checks["weights"]["summary"]
    assert (
        checks["data"]["status"] == "pass"
        and "1 batch digest and 1 sample count" in checks["data"]["summary"]
    )


def test_model_reinitialised_after_the_resume_loaded_it_is_named(crashed: Path, tmp_path: Path) -> None:
    """A callback re-initialises the weights at train begin (after the Trainer loaded checkpoint-10's): the restore
    event's digest, taken as the first resumed step finds the model, differs from checkpoint-10's."""
    out = resumed(crashed, tmp_path, bug="reinit_weights")
    res = CliRunner().invoke(cli, ["verify-resume", str(out)], terminal_width=200)
    assert res.exit_code == 1, res.output
    assert "weights after restore differ from checkpoint-10's: not restored (" in res.output
    result = verify_run(load_run(out), facts=TrainerCheckpointFacts(out))
    (v,) = result.verdicts
    w = v.check("weights")
    # the bug re-initialises the Linear weights only: embeddings and norms still hold checkpoint-10's values
    assert w.cause is Cause.WEIGHTS_NOT_RESTORED and 0 < w.numbers["not_restored"] < w.numbers["compared"]


def test_a_data_reset_in_a_trainer_run_is_caught_by_the_callbacks_batch_digests(data_reset: Path) -> None:
    # ignore_data_skip: the resumed Trainer starts the epoch's data from its first batch again
    out = data_reset
    result = verify_run(load_run(out), facts=TrainerCheckpointFacts(out))
    data = result.verdicts[0].check("data")
    assert data.status.value == "fail" and data.cause is Cause.DATA_POSITION_LOST
    assert result.causes[0] is Cause.DATA_POSITION_LOST


def test_a_data_reset_is_seen_in_trainer_state_alone_from_the_epoch_going_back(data_reset: Path) -> None:
    # logs only (no ledger, no checkpoint facts): the loss cannot show it, trainer_state.json's epoch can
    run = load_run(data_reset, "hf")
    assert any("epoch went back from 0.3125 at step 10 to 0.03125 at step 11" in n for n in run.notes)
    result = verify_run(run)
    assert result.exit_code == 1 and result.causes == [Cause.DATA_POSITION_LOST]
    v = result.verdicts[0]
    assert v.boundary.restored_step == 10 and v.boundary.restore.path == "checkpoint-10"
    assert v.check("position").confidence.value == "high"


def test_a_clean_trainer_resume_is_found_from_the_final_summary_and_passes(clean_resume: Path) -> None:
    # the values continue seamlessly (nothing differs between lineages), yet the final summary's
    # train_steps_per_second x train_runtime says the last train() call ran 10 steps: a resume from checkpoint-10
    run = load_run(clean_resume, "hf")
    assert any("resumed from checkpoint-10" in n for n in run.notes)
    result = verify_run(run, facts=TrainerCheckpointFacts(clean_resume))
    assert [v.boundary.restored_step for v in result.verdicts] == [10]
    assert result.exit_code == 0 and result.verdicts[0].check("position").status.value == "pass"


def test_a_trainer_dir_without_a_resume_says_so(straight: Path) -> None:
    run = load_run(straight, "hf")
    assert any(n.startswith("no trace of a resume in this Trainer output dir") for n in run.notes)
    assert any("ran all 20 steps" in n for n in run.notes)
    assert verify_run(run).exit_code == 0


def test_weights_lost_after_the_restore_are_not_blamed_on_the_optimizer(
    crashed: Path, tmp_path: Path
) -> None:
    # The optimizer, scheduler and data came back (the restore record shows the optimizer at step 10); the
    # weights did not.  Tolerance mode names the symptom; bitwise mode the first loss before any update.
    out = resumed(crashed, tmp_path, bug="reinit_weights")
    run = load_run(out)
    assert run.sessions[1].restores[0].optimizer_step == 10
    # Without checkpoint facts the loss check names the symptom; with them the weights check names the cause.
    tol = verify_run(run, options=VerifyOptions(deterministic=False))
    loss = tol.verdicts[0].check("loss")
    assert tol.causes == [Cause.LOSS_SHIFT] and Cause.OPTIMIZER_LOST not in tol.causes
    assert "loss level +" in loss.summary and "optimizer state was restored" in loss.summary
    exact = verify_run(run)
    assert exact.causes == [Cause.MODEL_STATE]
    facts = verify_run(run, options=VerifyOptions(deterministic=False), facts=TrainerCheckpointFacts(out))
    assert facts.causes == [Cause.WEIGHTS_NOT_RESTORED]


def test_checkpoint_without_scheduler_fails_naming_it(crashed: Path, tmp_path: Path) -> None:
    out = resumed(crashed, tmp_path, delete="scheduler.pt")
    res = CliRunner().invoke(cli, ["verify-resume", str(out)], terminal_width=200)
    assert res.exit_code == 1, res.output
    assert "scheduler.pt" in res.output and "warmup restarted" in res.output
    result = verify_run(load_run(out), facts=TrainerCheckpointFacts(out))
    assert result.causes[:2] == [Cause.STATE_MISSING, Cause.WARMUP_RESTARTED]
    counters = result.verdicts[0].check("counters")
    assert "checkpoint-10 has no scheduler.pt" in counters.summary
    # The Trainer's own logs alone (no ledger): the resume is suspected at checkpoint-10 and named too.
    hf = verify_run(load_run(out, "hf"), facts=TrainerCheckpointFacts(out))
    (v,) = hf.verdicts
    assert v.boundary.restored_step == 10 and v.boundary.reason.startswith("suspected")
    assert Cause.STATE_MISSING in hf.causes and Cause.WARMUP_RESTARTED in hf.causes


def test_trainer_checkpoint_facts_are_read_without_unpickling_code(crashed: Path) -> None:
    f = TrainerCheckpointFacts(crashed)(10, None)
    assert f is not None and f.step == 10 and f.scheduler_last_epoch == 10 and f.missing == ()
    assert set(f.optimizer_steps.values()) == {10} and f.scheduler_last_lr > 0


# ------------------------------------------------------------------------------- PEFT LoRA (issue 22)
LORA_STEPS, LORA_KILL_AT = 30, 25


@pytest.fixture(scope="module")
def lora_crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An all-linear LoRA (``peft.LoraConfig(target_modules="all-linear")``, PEFT's defaults) on the tiny Llama,
    checkpoints every 10 steps, SIGKILLed after step 25: ``checkpoint-20`` holds the adapter alone."""
    out = tmp_path_factory.mktemp("lora") / "out"
    rc = train(out, "--lora", "--steps", LORA_STEPS, "--save-every", 10, "--kill-at", LORA_KILL_AT)
    assert rc == -signal.SIGKILL
    ck = out / "checkpoint-20"
    assert (ck / "adapter_model.safetensors").is_file() and not (ck / "model.safetensors").exists()
    return out


def lora_resumed(crashed: Path, dest: Path, bug: str | None = None) -> Path:
    out = dest / "out"
    shutil.copytree(crashed, out)
    args = ("--lora", "--steps", LORA_STEPS, "--save-every", 10, "--resume", out / "checkpoint-20")
    assert train(out, *args, *(("--bug", bug) if bug else ())) == 0
    return out


def test_peft_adapter_reinitialised_after_the_resume_loaded_it_is_named(
    lora_crashed: Path, tmp_path: Path
) -> None:
    """lora_B back to PEFT's zeros after ``resume_from_checkpoint`` loaded checkpoint-20 (an adapter the resume
    silently dropped): the weights check compares the restore digest with the adapter file under the live
    PeftModel's names and names the lora_B tensors; the optimizer, which did come back, is not blamed."""
    out = lora_resumed(lora_crashed, tmp_path, bug="reinit_lora_b")
    run = load_run(out)
    assert run.sessions[1].restores[0].optimizer_step == 20
    res = CliRunner().invoke(cli, ["verify-resume", str(out), "--json"])
    assert res.exit_code == 1, res.output
    assert "optimizer state lost" not in res.output
    (b,) = json.loads(res.output)["boundaries"]
    checks = {c["check"]: c for c in b["checks"]}
    assert b["restored_step"] == 20 and checks["data"]["status"] == "pass", checks["data"]
    w = checks["weights"]
    assert w["status"] == "fail" and "weights after restore differ from checkpoint-20's" in w["summary"], w
    (v,) = verify_run(run, facts=TrainerCheckpointFacts(out)).verdicts
    assert v.check("weights").cause is Cause.WEIGHTS_NOT_RESTORED
    # every lora_B (one per linear module) differs, every lora_A came back; the frozen base is not in the file
    assert w["numbers"]["compared"] == 2 * w["numbers"]["not_restored"] > 0
    named = w["summary"].split("tensors differ: ", 1)[1]
    assert ".lora_B.default.weight" in named and ".lora_A." not in named


def test_clean_peft_resume_compares_the_adapter_and_passes(lora_crashed: Path, tmp_path: Path) -> None:
    out = lora_resumed(lora_crashed, tmp_path)
    res = CliRunner().invoke(cli, ["verify-resume", str(out), "--json"])
    assert res.exit_code == 0, res.output
    (b,) = json.loads(res.output)["boundaries"]
    w = {c["check"]: c for c in b["checks"]}["weights"]
    assert w["status"] == "pass" and "weights after restore equal checkpoint-20's" in w["summary"], w
    assert w["numbers"]["compared"] > 0 and w["numbers"]["not_restored"] == 0


# ------------------------------------------------------------------------------------ --format hf-trainer
def convert(*args: object) -> str:
    res = CliRunner().invoke(cli, ["convert", *map(str, args)])
    assert res.exit_code == 0, res.output
    return res.output


def test_trainium_layout_checkpoint_converts_to_a_folder_trainer_resumes_exactly(
    crashed: Path, straight: Path, tmp_path: Path
) -> None:
    """checkpoint-10 -> our format -> the Neuron layout (TP=2, fused qkv / gate-up, as the Trainium saver
    writes it) -> a Trainer checkpoint folder: the Trainer resumes from it and its next losses are the
    uninterrupted run's, bit for bit."""
    ck, trn, back = tmp_path / "ck", tmp_path / "trn", tmp_path / "checkpoint-10"
    convert(crashed / "checkpoint-10", ck, "--to", "cuda", "--format", "ckpt")
    convert(ck, trn, "--to", "neuron", "--tp", "2", "--format", "ckpt")
    said = convert(trn, back, "--to", "cuda", "--format", "hf-trainer")
    # what the folder does hold is not reported as left out (optimizer moments, param groups, scheduler, RNG)
    left = " ".join(ln for ln in said.splitlines() if "not written" in ln)
    assert not any(w in left for w in ("optimizer", "scheduler", "RNG")), said
    import torch

    a = torch.load(crashed / "checkpoint-10" / "optimizer.pt")
    b = torch.load(back / "optimizer.pt")
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    out = tmp_path / "out"
    shutil.copytree(crashed, out)
    shutil.rmtree(out / "checkpoint-10")  # the run resumes from the converted folder, outside output_dir
    assert train(out, "--resume", back) == 0
    want = losses(straight)
    got = {s: v for s, v in losses(out).items() if s > 10}
    assert got == {s: want[s] for s in range(11, STEPS + 1)}
    # the ledger names the folder the Trainer really restored, so verify-resume checks its counters
    (restore,) = read_jsonl(out / "ledger.jsonl").sessions[1].restores
    assert restore.step == 10 and restore.path == str(back)
    res = CliRunner().invoke(cli, ["verify-resume", str(out), "--json"])
    assert res.exit_code == 0, res.output
    (b,) = json.loads(res.output)["boundaries"]
    counters = {c["check"]: c for c in b["checks"]}["counters"]
    assert counters["status"] == "pass" and counters["numbers"]["scheduler_last_epoch"] == 10, counters


def test_trainer_checkpoint_with_foreign_grouping_is_refused(crashed: Path, tmp_path: Path) -> None:
    import torch

    src = tmp_path / "checkpoint-10"
    shutil.copytree(crashed / "checkpoint-10", src)
    opt = torch.load(src / "optimizer.pt")
    g0, g1 = opt["param_groups"]
    g0["params"], g1["params"] = g0["params"][:-1], [g0["params"][-1], *g1["params"]]
    torch.save(opt, src / "optimizer.pt")
    res = CliRunner().invoke(
        cli, ["convert", str(src), str(tmp_path / "dst"), "--to", "cuda", "--format", "ckpt"]
    )
    assert res.exit_code == 2 and "optimizer.pt: param_groups of [15, 6] parameters" in res.output
    assert "16 with weight decay + 5 without" in res.output and not (tmp_path / "dst").exists()


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_hostile_scheduler_pickle_is_refused_not_run(crashed: Path, tmp_path: Path) -> None:
    import torch

    src = tmp_path / "checkpoint-10"
    shutil.copytree(crashed / "checkpoint-10", src)
    torch.save({"last_epoch": 10, "x": _Evil()}, src / "scheduler.pt")
    res = CliRunner().invoke(
        cli, ["convert", str(src), str(tmp_path / "dst"), "--to", "cuda", "--format", "ckpt"]
    )
    assert res.exit_code == 2 and "scheduler.pt" in res.output and "posix.system" in res.output
    assert not (tmp_path / "dst").exists()


def test_diff_compares_trainer_checkpoints_their_optimizer_and_step(crashed: Path, tmp_path: Path) -> None:
    """``ckpt diff`` reads Trainer ``checkpoint-N`` folders like any source: weights, Adam moments and step."""
    import ckpt

    same = tmp_path / "ck10"
    conv = CliRunner().invoke(cli, ["convert", str(crashed / "checkpoint-10"), str(same), "--to", "cuda"])
    assert conv.exit_code == 0, conv.output
    res = ckpt.diff(str(crashed / "checkpoint-10"), str(same))
    assert res.same and res.optimizer == "compared" and res.step_a == res.step_b == 10
    assert any(t.role == "optimizer_state" for t in res.tensors)
    r = CliRunner().invoke(
        cli, ["diff", str(crashed / "checkpoint-5"), str(crashed / "checkpoint-10"), "--json"]
    )
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert doc["a"]["step"] == 5 and doc["b"]["step"] == 10 and doc["a"]["format"] == "hf-trainer"
    assert doc["changed"] and not doc["only_a"] and not doc["only_b"]
