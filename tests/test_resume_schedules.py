"""Runs shaped unlike the truth generator (tests/resume_schedule_runs.py: a memorising model whose loss steps
down at every epoch start, a logged curriculum, a real StepLR), each crashed right after checkpoint N and
resumed with no step overlapping: the verifier must pass the clean ones, catch the defects the logs show, and
say "cannot tell" (exit 0, a warning) where the logs cannot decide."""

from __future__ import annotations

from pathlib import Path

import pytest
from resume_schedule_runs import Plan, make_run

from ckpt.resume.checks import Cause, Status
from ckpt.resume.ledger import checkpoints_dir
from ckpt.resume.manifest_facts import ManifestFacts
from ckpt.resume.sources import load_run
from ckpt.resume.verify import Verification, verify_run

PLANS = {
    "clean_mid_epoch": Plan(56, log_epoch=False),
    "clean_before_epoch_start": Plan(60, log_epoch=False),
    "clean_at_epoch_start": Plan(64),
    "clean_at_epoch_start_unlogged": Plan(64, log_epoch=False),
    "loader_restart_unlogged": Plan(56, loader_restart=True, log_epoch=False),
    "loader_restart": Plan(56, loader_restart=True),
    "curriculum": Plan(60, curriculum_at=61),
    "curriculum_unlogged": Plan(60, curriculum_at=61, log_phase=False),
    "steplr_first_drop": Plan(20, step_lr=(20, 0.5)),
    "steplr_second_drop": Plan(40, step_lr=(20, 0.5)),
    "steplr_lr_halved": Plan(30, step_lr=(20, 0.5), lr_halved=True),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("schedules")
    return {name: make_run(plan, root / name) for name, plan in PLANS.items()}


def logs_only(run: Path) -> Verification:
    return verify_run(load_run(run / "tb", "tensorboard"))


def with_facts(run: Path) -> Verification:
    return verify_run(load_run(run, "jsonl"), facts=ManifestFacts(str(checkpoints_dir(run))))


@pytest.mark.parametrize(
    "name", ["clean_mid_epoch", "clean_before_epoch_start", "clean_at_epoch_start", "steplr_second_drop"]
)
def test_clean_resumes_of_a_run_whose_loss_steps_down_at_each_epoch_pass(
    runs: dict[str, Path], name: str
) -> None:
    for result in (logs_only(runs[name]), with_facts(runs[name])):
        assert result.exit_code == 0 and result.causes == [], result.causes
    # logs alone cannot decide the optimizer's moments and settings: said as "cannot tell", never a plain pass
    opt = logs_only(runs[name]).verdicts[0].check("optimizer")
    assert opt.status is Status.WARN and opt.summary.startswith("cannot tell") and "betas" in opt.summary


def test_a_drop_at_an_epoch_start_fits_the_runs_pattern_when_the_epoch_is_logged(
    runs: dict[str, Path],
) -> None:
    loss = logs_only(runs["clean_at_epoch_start"]).verdicts[0].check("loss")
    assert loss.status is Status.PASS and loss.numbers["drop_z"] < -4  # a real drop, explained
    assert "starts an epoch" in loss.summary


def test_a_drop_on_the_grid_of_earlier_unlogged_epoch_starts_cannot_be_told(runs: dict[str, Path]) -> None:
    result = logs_only(runs["clean_at_epoch_start_unlogged"])
    assert result.exit_code == 0 and result.causes == [Cause.CANNOT_TELL]
    assert "every 16 steps" in result.verdicts[0].check("loss").summary


def test_a_loader_restarted_mid_epoch_drops_the_loss_and_fails(runs: dict[str, Path]) -> None:
    # the earlier epoch drops are cut out of the noise estimate; the drop is judged, not let through by its sign
    loss = logs_only(runs["loader_restart_unlogged"]).verdicts[0].check("loss")
    assert loss.status is Status.FAIL and loss.cause is Cause.LOSS_DROP
    assert loss.numbers["level_changes_before"]  # the window's epoch drop did not inflate sigma
    # with the epoch logged, the position field shows it directly
    position = logs_only(runs["loader_restart"]).verdicts[0].check("position")
    assert position.status is Status.FAIL and position.cause is Cause.DATA_POSITION_LOST
    assert "epoch went back from 3.5 at step 56 to 3.0625 at step 57" in position.summary


def test_a_curriculum_switch_at_the_first_resumed_step_is_cannot_tell_not_a_failure(
    runs: dict[str, Path],
) -> None:
    for result in (logs_only(runs["curriculum"]), with_facts(runs["curriculum"])):
        loss = result.verdicts[0].check("loss")
        assert result.exit_code == 0 and loss.status is Status.WARN and loss.cause is Cause.CANNOT_TELL
        assert "data/phase=1" in loss.summary and "data/phase=2" in loss.summary


def test_a_steplr_milestone_at_the_first_resumed_step(runs: dict[str, Path]) -> None:
    first = logs_only(runs["steplr_first_drop"]).verdicts[0].check("lr")
    assert first.status is Status.WARN and first.cause is Cause.CANNOT_TELL  # logs alone cannot decide
    exact = with_facts(runs["steplr_first_drop"]).verdicts[0].check("lr")
    assert (
        exact.status is Status.PASS and exact.basis.value == "checkpoint facts"
    )  # the scheduler's state can
    second = logs_only(runs["steplr_second_drop"]).verdicts[0].check("lr")
    assert second.status is Status.PASS and "every 20 steps" in second.summary


def test_a_halved_lr_off_the_milestones_is_cannot_tell_from_logs_and_fails_with_the_scheduler_state(
    runs: dict[str, Path],
) -> None:
    assert logs_only(runs["steplr_lr_halved"]).verdicts[0].check("lr").cause is Cause.CANNOT_TELL
    result = with_facts(runs["steplr_lr_halved"])
    assert result.exit_code == 1 and result.verdicts[0].check("lr").status is Status.FAIL


def test_a_loss_only_shift_where_every_restored_state_is_exact_is_cannot_tell(runs: dict[str, Path]) -> None:
    # no phase logged: the logs alone see a level shift (a failure); the ledger's restore digest and the
    # checkpoint's counters show every state restored exactly, so the shift is named a possible schedule
    assert logs_only(runs["curriculum_unlogged"]).verdicts[0].check("loss").cause is Cause.LOSS_SHIFT
    result = with_facts(runs["curriculum_unlogged"])
    loss = result.verdicts[0].check("loss")
    assert result.exit_code == 0 and loss.status is Status.WARN and loss.cause is Cause.CANNOT_TELL
    assert "every restored state checks out exactly" in loss.summary
