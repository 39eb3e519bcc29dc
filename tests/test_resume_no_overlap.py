"""Each resume defect of the real example trainer, with and without overlap, in every log format.

The fixtures (fixtures/resume, made by ``fixtures/resume/make_cases.py``) are runs of ``examples/tiny_llama.py``
SIGKILLed after step 28 (``overlap``: steps 26..28 were logged before the crash) or right after the checkpoint
of step 25 committed (``no_overlap``: nothing after the restore point was logged), each resumed with one
defect.  :data:`EXPECTED` is the table of docs/verify-resume.md ("What each mode can see"): which defect is
named in which format, and which is invisible there and why.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from resume_cases import FORMATS, facts_of, ledger_run, write_format

from ckpt.resume.checks import Basis, Cause, Confidence, Status
from ckpt.resume.checks.lr_trajectory import scan
from ckpt.resume.model import Run, Session, StepRecord
from ckpt.resume.sources import load_run
from ckpt.resume.verify import verify_run

MODES = ("overlap", "no_overlap")
ALL = {fmt: True for fmt in FORMATS}
# defect -> formats (and modes) where it is named; elsewhere the run must come out continuous.
EXPECTED: dict[str, tuple[Cause, dict[str, bool | set[str]]]] = {
    "scheduler_not_restored": (Cause.WARMUP_RESTARTED, ALL),
    "scheduler_last_epoch": (Cause.LR_OFF_BY_ONE, ALL),
    # digests: the ledger and a CSV that carries them; TensorBoard and the Trainer log none
    "rng_not_restored": (Cause.RNG_NOT_RESTORED, {"ledger": True, "csv": True}),
    "data_position_lost": (Cause.DATA_POSITION_LOST, {"ledger": True, "tensorboard": True, "csv": True}),
    # bitwise only: the lost moments move this small model's loss less than its noise
    "optimizer_dropped": (Cause.OPTIMIZER_LOST, {"ledger": {"overlap"}}),
    # needs save events (the ledger's); the Trainer overwrites the re-saved checkpoints
    "older_checkpoint": (Cause.OLDER_CHECKPOINT, {"ledger": True}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], Run]:
    out = {}
    for mode in MODES:
        for defect in ("none", *EXPECTED):
            ledger = ledger_run(mode, defect)
            for fmt in FORMATS:
                path = write_format(ledger, fmt, tmp_path_factory.mktemp(f"{mode}-{defect}-{fmt}"))
                out[mode, defect, fmt] = load_run(path)
    return out


def _named(defect: str, mode: str, fmt: str) -> Cause | None:
    if defect == "none":
        return None
    cause, where = EXPECTED[defect]
    w = where.get(fmt, False)
    return cause if w is True or (isinstance(w, set) and mode in w) else None


@pytest.mark.parametrize("with_facts", [True, False], ids=["facts", "log-only"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", MODES)
def test_every_defect_in_every_format(runs, mode: str, fmt: str, with_facts: bool) -> None:
    for defect in ("none", *EXPECTED):
        run = runs[mode, defect, fmt]
        result = verify_run(run, facts=facts_of(mode, defect) if with_facts else None)
        want = _named(defect, mode, fmt)
        got = result.causes
        assert got == ([want] if want else []), (
            defect,
            [(c.name, c.status, c.summary) for v in result.verdicts for c in v.checks],
        )
        if want is None:
            assert result.exit_code == 0
        else:
            assert result.exit_code == 1 and len(result.verdicts) == 1
            assert result.verdicts[0].boundary.restored_step == 25 or defect == "older_checkpoint"


def test_no_overlap_lr_is_judged_against_the_checkpoint_then_the_trajectory(runs) -> None:
    run = runs["no_overlap", "scheduler_last_epoch", "ledger"]
    lr = verify_run(run, facts=facts_of("no_overlap", "scheduler_last_epoch")).verdicts[0].check("lr")
    # The checkpoint's scheduler says exactly what step 26 must use; the log's value is the next step's.
    assert (lr.basis, lr.confidence, lr.cause) == (Basis.CHECKPOINT, Confidence.EXACT, Cause.LR_OFF_BY_ONE)
    assert (
        lr.numbers["expected"] == pytest.approx(0.0013495967391589758)
        and lr.numbers["got"] != lr.numbers["expected"]
    )
    alone = verify_run(run).verdicts[0].check("lr")
    assert (alone.basis, alone.confidence, alone.cause) == (
        Basis.TRAJECTORY,
        Confidence.HIGH,
        Cause.LR_OFF_BY_ONE,
    )
    assert alone.numbers["shift_steps"] == 1
    good = verify_run(runs["no_overlap", "none", "ledger"], facts=facts_of("no_overlap", "none")).verdicts[0]
    assert (good.check("lr").basis, good.check("lr").confidence) == (Basis.CHECKPOINT, Confidence.EXACT)
    assert good.check("loss").basis is Basis.TRAJECTORY
    over = verify_run(runs["overlap", "none", "ledger"]).verdicts[0].check("lr")
    assert (over.basis, over.confidence) == (Basis.OVERLAP, Confidence.EXACT)


def test_restart_after_one_right_step_is_named(runs) -> None:
    """Optimizer restored, scheduler not: step 26 uses the restored LR (right), then the fresh scheduler's
    second value: the warmup restarts one step late, and the verdict says so."""
    (v,) = verify_run(runs["no_overlap", "scheduler_not_restored", "tensorboard"]).verdicts
    lr = v.check("lr")
    assert lr.cause is Cause.WARMUP_RESTARTED and lr.basis is Basis.TRAJECTORY
    assert lr.numbers["first_bad_step"] == 27 and "1 step after the resume" in lr.summary


def test_hf_log_without_sessions_reports_the_suspected_resume(runs) -> None:
    result = verify_run(runs["no_overlap", "scheduler_not_restored", "hf"])
    (v,) = result.verdicts
    assert v.boundary.restored_step == 25 and v.boundary.reason.startswith("suspected")
    assert result.causes == [Cause.WARMUP_RESTARTED]
    # A continuous HF run has the same checkpoints and no suspected boundary at any of them.
    assert verify_run(runs["no_overlap", "none", "hf"]).verdicts == []


def test_csv_without_sessions_judges_each_checkpoint_only_with_save_events(runs, tmp_path: Path) -> None:
    from resume_cases import write_csv

    bad = load_run(
        write_csv(ledger_run("no_overlap", "scheduler_not_restored"), tmp_path / "m.csv", sessions=False)
    )
    assert not bad.sessions_logged
    # No session column, no step going back, no save events: nothing marks a resume (docs: not detectable).
    assert verify_run(bad).verdicts == []


# ----------------------------------------------------------------------------- synthetic trajectory cases
def _sched(i: int, total: int = 200, warmup: int = 20) -> float:
    if i < warmup:
        return 1e-3 * (i + 1) / warmup
    return 1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * (i - warmup) / (total - warmup)))


@pytest.mark.parametrize(
    ("post_lr", "cause", "shift"),
    [
        (lambda s: _sched(s - 1), None, None),
        (lambda s: _sched(s + 2), Cause.LR_SHIFTED, 3),
        (lambda s: _sched(s - 1 - 40), Cause.LR_SHIFTED, -40),
        (lambda s: _sched(s - 101), Cause.WARMUP_RESTARTED, -100),
        (lambda s: _sched(100), Cause.LR_FROZEN, None),
        (lambda s: 5 * _sched(s - 1), Cause.LR_DIFFERENT, None),
    ],
    ids=["continuous", "ahead-3", "behind-40", "restart", "frozen", "jump"],
)
def test_lr_trajectory_names_the_pattern(post_lr, cause: Cause | None, shift: int | None) -> None:
    pre = [(s, _sched(s - 1)) for s in range(1, 101)]
    post = [(s, post_lr(s)) for s in range(101, 121)]
    f = scan(pre, post, 100, "float64")
    assert f is not None and f.cause is cause, f
    if shift is not None:
        assert f.numbers["shift_steps"] == shift


def test_warmup_to_decay_kink_is_not_a_jump() -> None:
    pre = [(s, _sched(s - 1)) for s in range(1, 21)]
    post = [(s, _sched(s - 1)) for s in range(21, 40)]
    assert scan(pre, post, 20, "float32").cause is None


def _run(losses: dict[int, float], restored: int) -> Run:
    a = Session("a", [StepRecord(s, v, 1e-3) for s, v in losses.items() if s <= restored])
    b = Session("b", [StepRecord(s, v, 1e-3) for s, v in losses.items() if s > restored])
    return Run(path="x", source="test", sessions=[a, b])


def test_loss_jump_hidden_by_the_early_drop_is_found_with_local_noise() -> None:
    """The loss falls steeply for 50 steps, then flattens; a jump of 0.15 after a resume at step 120 is ~5x the
    local noise but small next to the early drop's step-to-step changes."""
    import random

    rng = random.Random(3)
    losses = {s: 2.0 + 6.0 * math.exp(-s / 12) + rng.gauss(0, 0.02) for s in range(1, 161)}
    clean = verify_run(_run(losses, 120)).verdicts[0].check("loss")
    assert clean.status is Status.PASS and clean.basis is Basis.TRAJECTORY
    bumped = {s: v + (0.15 if s > 120 else 0.0) for s, v in losses.items()}
    loss = verify_run(_run(bumped, 120)).verdicts[0].check("loss")
    assert loss.status is Status.FAIL and loss.cause is Cause.LOSS_SHIFT and loss.basis is Basis.TRAJECTORY
    assert loss.numbers["level_z"] > 5


def test_warmup_into_a_constant_lr_is_not_a_frozen_scheduler() -> None:
    """``constant_with_warmup`` checkpointed at the end of its warmup: rising, then constant, legitimately."""
    pre = [(s, 1e-3 * min(s, 10) / 10) for s in range(1, 11)]
    post = [(s, 1e-3) for s in range(11, 30)]
    assert scan(pre, post, 10, "float64").cause is None
