"""A real (tiny) training loop resumed correctly and with each classic bug: the verifier must pass the
correct run without a single warning and name the right cause for each broken one."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_resume_sim import VARIANTS, simulate

from ckpt.resume.checks import Cause, Status, VerifyOptions
from ckpt.resume.sources import load_run
from ckpt.resume.verify import Verification, verify_run

EXPECTED = {
    "scheduler_not_restored": Cause.WARMUP_RESTARTED,
    "rng_not_restored": Cause.RNG_NOT_RESTORED,
    "optimizer_dropped": Cause.OPTIMIZER_LOST,
    "data_position_lost": Cause.DATA_POSITION_LOST,
    "scheduler_last_epoch": Cause.LR_OFF_BY_ONE,
    "older_checkpoint": Cause.OLDER_CHECKPOINT,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {v: simulate(tmp_path_factory.mktemp(v), v) for v in VARIANTS}


def _verify(path: Path, deterministic: bool | None = None) -> Verification:
    return verify_run(load_run(path), options=VerifyOptions(deterministic=deterministic))


def _assert_clean(result: Verification) -> None:
    assert len(result.verdicts) == 1
    bad = [
        (c.name, c.status, c.summary)
        for v in result.verdicts
        for c in v.checks
        if c.status in (Status.WARN, Status.FAIL)
    ]
    assert bad == []
    assert result.exit_code == 0 and result.causes == []


@pytest.mark.parametrize("deterministic", [None, False])
def test_correct_resume_passes_without_any_warning(runs: dict[str, Path], deterministic: bool | None) -> None:
    result = _verify(runs["correct"], deterministic)
    _assert_clean(result)
    verdict = result.verdicts[0]
    assert verdict.deterministic is (deterministic is None)
    assert {c.name for c in verdict.checks if c.status is Status.PASS} >= {
        "step",
        "lr",
        "data",
        "rng",
        "loss",
        "lost_work",
        "env",
    }


def test_nondeterministic_resume_passes_in_tolerance_mode(runs: dict[str, Path]) -> None:
    result = _verify(runs["nondeterministic"])
    _assert_clean(result)
    loss = result.verdicts[0].check("loss")
    assert loss.status is Status.PASS and loss.numbers["deterministic"] is False


@pytest.mark.parametrize("variant", sorted(EXPECTED))
def test_broken_resume_fails_with_its_cause(runs: dict[str, Path], variant: str) -> None:
    result = _verify(runs[variant])
    assert result.exit_code == 1
    assert result.causes == [EXPECTED[variant]], [c.summary for c in result.verdicts[0].checks]


@pytest.mark.parametrize("variant", sorted(set(EXPECTED) - {"optimizer_dropped"}))
def test_exact_checks_name_the_cause_in_tolerance_mode_too(runs: dict[str, Path], variant: str) -> None:
    # LR, data/RNG digests, steps and save events are exact even when losses are not comparable bit for bit.
    result = _verify(runs[variant], deterministic=False)
    assert result.exit_code == 1
    assert result.causes == [EXPECTED[variant]]


def test_details_carry_the_deciding_numbers(runs: dict[str, Path]) -> None:
    lr = _verify(runs["scheduler_not_restored"]).verdicts[0].check("lr")
    assert (
        lr.numbers["first_mismatch"] == 61 and lr.numbers["got"] == 0.001
    )  # base_lr * 1/warmup: step 1's LR
    data = _verify(runs["data_position_lost"]).verdicts[0].check("data")
    assert data.numbers["repeats_step"] == 1 and "samples repeated" in data.summary
    rng = _verify(runs["rng_not_restored"]).verdicts[0].check("rng")
    assert "re-seeded" in rng.summary
    lost = _verify(runs["older_checkpoint"]).verdicts[0].check("lost_work")
    assert (lost.numbers["restored_step"], lost.numbers["newest_save"]) == (40, 60)
    loss = _verify(runs["rng_not_restored"]).verdicts[0].check("loss")
    assert loss.status is Status.FAIL and loss.explained_by == [Cause.RNG_NOT_RESTORED]
