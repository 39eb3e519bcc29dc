"""Every reader gives the same run: JSONL ledger, TensorBoard events (orphans kept), CSV, HF trainer_state."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from test_resume_sim import SimConfig, simulate

from ckpt.resume.checks import Cause
from ckpt.resume.errors import RunInputError
from ckpt.resume.model import Run
from ckpt.resume.sources import load_run, read_tensorboard
from ckpt.resume.sources.tensorboard import iter_records
from ckpt.resume.verify import verify_run


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    out = {}
    for v in ("correct", "scheduler_not_restored"):
        out[v] = load_run(simulate(tmp_path_factory.mktemp(v), v))
    return out


def _write_tb(run: Run, logdir: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    for i, session in enumerate(run.sessions):
        # The resumed writer purges from its first step, as recommended: TensorBoard would then drop the
        # dead session's steps above it ("orphaned"); our reader must keep them.
        w = SummaryWriter(str(logdir), purge_step=session.steps[0].step if i else None)
        for r in session.steps:
            w.add_scalar("train/loss", r.loss, r.step)
            w.add_scalar("train/lr", r.lr, r.step)
            w.add_scalar("eval/loss", 0.0, r.step)  # another stream: ignored, prefers train/
        w.close()


def _key(run: Run, f32: bool = False) -> list[list[tuple]]:
    cast = (lambda x: float(np.float32(x))) if f32 else (lambda x: x)
    return [[(r.step, cast(r.loss), cast(r.lr)) for r in s.steps] for s in run.sessions]


@pytest.mark.parametrize("variant", ["correct", "scheduler_not_restored"])
def test_tensorboard_sessions_keep_orphaned_pre_crash_steps(
    sim: dict[str, Run], tmp_path: Path, variant: str
) -> None:
    ref = sim[variant]
    _write_tb(ref, tmp_path)
    tb = load_run(tmp_path)
    assert tb.source == "tensorboard" and tb.precision == "float32"
    assert _key(tb) == _key(ref, f32=True)
    assert [r.step for r in tb.sessions[0].steps][-15:] == list(range(61, 76))  # the orphans
    result = verify_run(tb)
    assert result.causes == ([] if variant == "correct" else [Cause.WARMUP_RESTARTED])


def test_tensorboard_own_loader_drops_the_orphans(sim: dict[str, Run], tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write_tb(sim["correct"], tmp_path)
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert len(steps) < sum(len(s.steps) for s in sim["correct"].sessions)  # why we parse the files ourselves


def test_tensorboard_truncated_record_is_noted(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path))
    for s in range(1, 6):
        w.add_scalar("loss", 1.0 / s, s)
        w.add_scalar("lr", 0.1, s)
    w.close()
    (f,) = list(tmp_path.glob("*tfevents*"))
    f.write_bytes(f.read_bytes()[:-7])
    notes: list[str] = []
    assert iter_records(f, notes) and "truncated" in notes[0]
    run = read_tensorboard(tmp_path)
    assert [r.step for r in run.sessions[0].steps] == [1, 2, 3, 4, 5]


def test_tensorboard_of_a_trainer_with_evaluation_reads_the_training_loss(tmp_path: Path) -> None:
    # the Trainer's TensorBoardCallback with eval_strategy: train/loss every step, eval/loss every 5th,
    # train/train_loss once at the end (the run's mean)
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path))
    for s in range(1, 11):
        w.add_scalar("train/loss", 2.0 + s, s)
        w.add_scalar("train/learning_rate", 0.1, s)
        if s % 5 == 0:
            w.add_scalar("eval/loss", 9.0, s)
    w.add_scalar("train/train_loss", 5.5, 10)
    w.close()
    run = read_tensorboard(tmp_path)
    assert [r.loss for r in run.sessions[0].steps] == [2.0 + s for s in range(1, 11)]


def test_tensorboard_rejects_a_non_event_file(tmp_path: Path) -> None:
    (tmp_path / "events.out.tfevents.bogus").write_bytes(b"x" * 64)
    with pytest.raises(RunInputError, match="CRC"):
        read_tensorboard(tmp_path)


def _write_csv(run: Run, path: Path, with_session: bool) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(
            ["step", "loss", "learning_rate", "grad_norm", "samples", "data_digest", "rng_digest", "time"]
            + (["session"] if with_session else [])
        )
        for s in run.sessions:
            for r in s.steps:
                row = [
                    r.step,
                    repr(r.loss),
                    repr(r.lr),
                    repr(r.grad_norm),
                    r.samples,
                    r.data_digest,
                    r.rng_digest,
                    repr(r.time),
                ]
                w.writerow(row + ([s.id] if with_session else []))


@pytest.mark.parametrize("with_session", [True, False])
def test_csv_gives_the_same_run(sim: dict[str, Run], tmp_path: Path, with_session: bool) -> None:
    for variant, ref in sim.items():
        path = tmp_path / f"{variant}.csv"
        _write_csv(ref, path, with_session)
        run = load_run(path)
        if with_session:
            assert _key(run) == _key(ref)
        # Without a session column the step going back marks the boundary; verdicts are the same.
        causes = verify_run(run).causes
        assert causes == ([] if variant == "correct" else [Cause.WARMUP_RESTARTED])


def _hf_state(records: list, path: Path) -> None:
    history = [
        {
            "epoch": r.step / 16,
            "grad_norm": r.grad_norm,
            "learning_rate": r.lr,
            "loss": round(r.loss, 4),
            "step": r.step,
        }
        for r in records
    ]
    history.append({"eval_loss": 1.0, "step": records[-1].step})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"global_step": records[-1].step, "log_history": history}))


def _hf_layout(run: Run, out: Path, restored: int, every: int, post_every: int = 20) -> None:
    dead, post = run.sessions
    main = [r for r in dead.steps if r.step <= restored] + post.steps
    for s in range(every, dead.steps[-1].step + 1, every):
        _hf_state([r for r in dead.steps if r.step <= s], out / f"checkpoint-{s}" / "trainer_state.json")
    for s in range(restored + post_every, main[-1].step + 1, post_every):
        _hf_state([r for r in main if r.step <= s], out / f"checkpoint-{s}" / "trainer_state.json")
    _hf_state(main, out / "trainer_state.json")


def test_hf_trainer_state_single_lineage(sim: dict[str, Run], tmp_path: Path) -> None:
    _hf_layout(sim["correct"], tmp_path, restored=60, every=20)
    run = load_run(tmp_path)
    assert run.source == "hf" and len(run.sessions) == 1
    steps = run.sessions[0].steps
    assert [r.step for r in steps] == list(range(1, 121))
    assert verify_run(run).exit_code == 0


def test_hf_dead_lineage_becomes_a_session(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    cfg = SimConfig(save_every=10)
    ref = load_run(simulate(tmp_path_factory.mktemp("hf"), "scheduler_not_restored+older", cfg))
    # The dead process also wrote checkpoint-70; the resumed one saves at 80, 100, 120 and never overwrote it.
    _hf_layout(ref, tmp_path, restored=60, every=10)
    run = load_run(tmp_path)
    assert len(run.sessions) == 2
    dead, final = run.sessions
    assert dead.steps[-1].step == 70 and final.restores[0].step == 60 and final.restores[0].inferred
    assert set(verify_run(run).causes) == {Cause.WARMUP_RESTARTED, Cause.OLDER_CHECKPOINT}


def test_auto_detection_and_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(RunInputError, match="does not exist"):
        load_run(tmp_path / "missing")
    with pytest.raises(RunInputError, match="no ledger.jsonl"):
        load_run(tmp_path)
    (tmp_path / "a.csv").write_text("step,loss\n")
    (tmp_path / "b.csv").write_text("step,loss\n")
    with pytest.raises(RunInputError, match="several CSV"):
        load_run(tmp_path)
    with pytest.raises(RunInputError, match="has no rows"):
        load_run(tmp_path / "a.csv")
