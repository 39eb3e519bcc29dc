"""Checks on synthetic LLM-like ledgers: tolerance mode, spikes, replayed schedules, facts, env drift."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from ckpt.resume.checks import Basis, Cause, Confidence, Status, VerifyOptions
from ckpt.resume.facts import CheckpointFacts, facts_from_mapping
from ckpt.resume.ledger import LedgerWriter
from ckpt.resume.replay import replay_lr
from ckpt.resume.sources import load_run
from ckpt.resume.verify import Verification, verify_run

TOTAL, WARMUP, BASE_LR = 1500, 100, 3e-4


def lr_factor(i: int) -> float:
    if i < WARMUP:
        return (i + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (i - WARMUP) / (TOTAL - WARMUP)))


def factory(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


SCHEDULE = replay_lr(factory, base_lr=BASE_LR, steps=TOTAL)


def curve(step: int, rng: random.Random) -> float:
    return 2.0 + 8.0 / math.sqrt(step) + rng.gauss(0.0, 0.03)


def write(
    run_dir: Path,
    *,
    crash: int = 750,
    restored: int = 700,
    first: int | None = None,
    end: int = 900,
    seed2: int = 2,
    bump: float = 0.0,
    lr_shift: int = 0,
    env2: dict | None = None,
    deterministic: bool = False,
) -> Path:
    rng = random.Random(1)
    with LedgerWriter(run_dir, deterministic=deterministic, world_size=8, tokenizer_id="tok@1") as w:
        for s in range(1, crash + 1):
            w.step(s, curve(s, rng), SCHEDULE[s])
            if s % 100 == 0:
                w.save(s, f"ckpt/step-{s}", 0.5, 4.0)
    rng = random.Random(seed2)
    env2 = {"world_size": 8, "tokenizer_id": "tok@1", **(env2 or {})}
    with LedgerWriter(
        run_dir,
        deterministic=deterministic,
        world_size=env2.pop("world_size"),
        tokenizer_id=env2.pop("tokenizer_id"),
        extra_env=env2,
    ) as w:
        w.restore(restored, f"ckpt/step-{restored}", 12.0)
        w.compile(30.0, "train graph")
        for s in range((first or restored + 1), end + 1):
            extra = bump * math.exp(-(s - restored - 1) / 15) if bump else 0.0
            lr = SCHEDULE.get(s + lr_shift) if s + lr_shift > 0 else SCHEDULE[1]
            w.step(s, curve(s, rng) + extra, lr)
    return run_dir


def verify(path: Path, **kw) -> Verification:
    return verify_run(load_run(path), **kw)


def test_nondeterministic_resume_within_noise_passes(tmp_path: Path) -> None:
    result = verify(write(tmp_path))
    loss = result.verdicts[0].check("loss")
    assert loss.status is Status.PASS and not loss.numbers["deterministic"]
    assert result.causes == [] and result.exit_code == 0


def test_loss_spike_after_resume_names_the_symptom_not_a_guessed_cause(tmp_path: Path) -> None:
    # Nothing in the log says which state was lost: the verdict names the symptom and what to check.
    result = verify(write(tmp_path, bump=0.6))
    assert result.causes == [Cause.LOSS_SHIFT]
    loss = result.verdicts[0].check("loss")
    assert (
        loss.numbers["paired_t"] > 3 and "loss level +" in loss.summary and "optimizer state" in loss.summary
    )


def test_bitwise_mode_flags_any_difference(tmp_path: Path) -> None:
    result = verify(write(tmp_path), options=VerifyOptions(deterministic=True))
    loss = result.verdicts[0].check("loss")
    # the first loss differs, but no batch digest says the batch was the same: the symptom, not the model state
    assert loss.status is Status.FAIL and loss.cause is Cause.LOSS_DIVERGED
    assert "no batch digest" in loss.summary


def test_no_overlap_uses_the_replayed_schedule(tmp_path: Path) -> None:
    good = write(tmp_path / "good", crash=700)
    traj = verify(good).verdicts[0].check("lr")
    assert traj.status is Status.PASS and (traj.basis, traj.confidence) == (Basis.TRAJECTORY, Confidence.HIGH)
    lr = verify(good, lr_reference=SCHEDULE).verdicts[0].check("lr")
    assert lr.status is Status.PASS and lr.numbers["compared"] == 200
    assert (lr.basis, lr.confidence) == (Basis.REPLAY, Confidence.EXACT)
    shift = write(tmp_path / "shift", crash=700, lr_shift=1)
    shifted = verify(shift, lr_reference=SCHEDULE)
    assert shifted.causes == [Cause.LR_OFF_BY_ONE]
    # Without the replayed schedule, the trajectory alone: same slope on both sides, a gap of two steps.
    alone = verify(shift).verdicts[0].check("lr")
    assert alone.cause is Cause.LR_OFF_BY_ONE and alone.basis is Basis.TRAJECTORY
    assert alone.numbers["shift_steps"] == 1


def test_restarted_warmup_is_recognised_without_overlap_or_replay(tmp_path: Path) -> None:
    result = verify(write(tmp_path, crash=700, lr_shift=-700))
    assert result.causes == [Cause.WARMUP_RESTARTED]


@pytest.mark.parametrize(("first", "cause"), [(705, Cause.STEPS_SKIPPED), (650, Cause.STEPS_REPEATED)])
def test_step_continuity(tmp_path: Path, first: int, cause: Cause) -> None:
    result = verify(write(tmp_path, first=first))
    assert result.verdicts[0].check("step").cause is cause and cause in result.causes


@pytest.mark.parametrize(
    ("facts", "cause"),
    [
        (CheckpointFacts(700, {"adamw": 700}, 700, None, "tok@1"), None),
        (CheckpointFacts(700, {"adamw": 0}, 700), Cause.OPTIMIZER_LOST),
        (CheckpointFacts(700, {"adamw": 700}, 0), Cause.WARMUP_RESTARTED),
        (CheckpointFacts(700, {"adamw": 700}, 701), Cause.LR_OFF_BY_ONE),
        (CheckpointFacts(700, None, None, None, "tok@2"), Cause.TOKENIZER_CHANGED),
    ],
)
def test_checkpoint_facts(tmp_path: Path, facts: CheckpointFacts, cause: Cause | None) -> None:
    result = verify(write(tmp_path), facts=facts_from_mapping({700: facts}))
    counters = result.verdicts[0].check("counters")
    assert counters.cause is cause
    assert counters.status is (Status.PASS if cause is None else Status.FAIL)


def test_version_drift_warns_and_tokenizer_change_fails(tmp_path: Path) -> None:
    result = verify(write(tmp_path / "a", env2={"torch": "0.0.1-other", "world_size": 16}))
    env = result.verdicts[0].check("env")
    assert env.status is Status.WARN and env.cause is Cause.ENV_DRIFT and result.exit_code == 0
    assert "expect recompilation on Neuron" in env.summary and "re-split" in env.summary
    result = verify(write(tmp_path / "b", env2={"tokenizer_id": "tok@2"}))
    assert result.causes == [Cause.TOKENIZER_CHANGED] and result.exit_code == 1


def test_several_failures_and_in_process_restore(tmp_path: Path) -> None:
    write(tmp_path)  # sessions 1-2: crash at 750, resume from 700 to 900
    rng = random.Random(3)
    with LedgerWriter(tmp_path) as w:  # session 3: resume from 900, in-process retry from 950 at 980
        w.restore(900, "ckpt/step-900", 5.0)
        for s in range(901, 981):
            w.step(s, curve(s, rng), SCHEDULE[s])
            if s == 950:
                w.save(s, "ckpt/step-950", 0.5, 2.0)
        w.restore(950, "ckpt/step-950", 1.0)
        for s in range(951, 1001):
            w.step(s, curve(s, rng), SCHEDULE[s])
    result = verify(tmp_path)
    assert [v.boundary.restored_step for v in result.verdicts] == [700, 900, 950]
    assert [v.boundary.reason for v in result.verdicts] == ["restore event"] * 3
    assert result.exit_code == 0, [
        c.summary for v in result.verdicts for c in v.checks if c.status is Status.FAIL
    ]
    lost = [v.check("lost_work").numbers["steps_recomputed"] for v in result.verdicts]
    assert lost == [50, 0, 30]


def test_replay_matches_a_real_training_schedule() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=BASE_LR)
    sched = factory(opt)
    for s in range(1, 50):
        assert opt.param_groups[0]["lr"] == SCHEDULE[s]
        opt.step()
        sched.step()


def test_recovery_cost_from_events(tmp_path: Path) -> None:
    from ckpt.resume.cost import recovery_cost

    cost = recovery_cost(load_run(write(tmp_path)))
    (f,) = cost.failures
    assert (f.crash_step, f.restored_step, f.steps_recomputed) == (750, 700, 50)
    assert (f.restore_seconds, f.compile_seconds, f.compile_events) == (12.0, 30.0, 1)
    assert cost.saves == 7 and cost.save_blocking_seconds == 3.5 and cost.save_background_seconds == 24.5
