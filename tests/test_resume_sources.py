"""The table of log sources: detection order, file names, ``--source`` choices, and adding a source.

Real logs of each format side by side in one run directory (a ledger from :class:`LedgerWriter`, TensorBoard
events from torch's ``SummaryWriter``, a Trainer state, a CSV): each added log of a higher priority takes
over, as ``detect_source`` promises (ledger, then HF, then TensorBoard, then one CSV).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt.cli.compare import compare
from ckpt.cli.report import report
from ckpt.cli.verify_resume import verify_resume

from ckpt.resume import sources
from ckpt.resume.errors import RunInputError
from ckpt.resume.ledger import LedgerWriter, ledger_path
from ckpt.resume.model import Run, Session, StepRecord
from ckpt.resume.sources import SOURCES, TABLE, LogSource, detect_source, load_run

LOSSES = [(1, 2.5, 0.1), (2, 2.25, 0.1), (3, 2.125, 0.05)]


def _csv(d: Path) -> Path:
    path = d / "metrics.csv"
    path.write_text("step,loss,lr\n" + "".join(f"{s},{x!r},{lr!r}\n" for s, x, lr in LOSSES))
    return path


def _tensorboard(d: Path) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(d / "tb"))
    for s, x, lr in LOSSES:
        w.add_scalar("train/loss", x, s)
        w.add_scalar("train/lr", lr, s)
    w.close()
    (events,) = (d / "tb").iterdir()
    return events


def _trainer_state(d: Path) -> Path:
    path = d / "trainer_state.json"
    history = [{"step": s, "loss": x, "learning_rate": lr} for s, x, lr in LOSSES]
    path.write_text(json.dumps({"global_step": LOSSES[-1][0], "log_history": history}))
    return path


def _ledger(d: Path) -> Path:
    with LedgerWriter(d) as ledger:
        for s, x, lr in LOSSES:
            ledger.step(s, x, lr)
    return ledger_path(d)


def test_each_log_of_higher_priority_takes_over(tmp_path: Path) -> None:
    files = {}
    for kind, write in (
        ("csv", _csv),
        ("tensorboard", _tensorboard),
        ("hf", _trainer_state),
        ("jsonl", _ledger),
    ):
        files[kind] = write(tmp_path)
        assert detect_source(tmp_path) == kind
        run = load_run(tmp_path)
        assert run.source == kind and [r.step for s in run.sessions for r in s.steps] == [1, 2, 3]
    for kind, path in files.items():  # a single file is recognised by its name, whatever lies beside it
        assert detect_source(path) == kind and load_run(path).source == kind


def test_nothing_recognised_names_every_source_in_priority_order(tmp_path: Path) -> None:
    with pytest.raises(RunInputError) as exc:
        load_run(tmp_path)
    assert str(exc.value) == f"no ledger.jsonl, trainer_state.json, TensorBoard events or CSV in {tmp_path}"
    notes = tmp_path / "notes.txt"
    notes.write_text("step 1 loss 2.5\n")
    with pytest.raises(RunInputError, match="cannot tell the format of .*notes.txt; pass --source"):
        load_run(notes)
    with pytest.raises(RunInputError, match="unknown source 'wandb'; expected one of auto, jsonl"):
        load_run(tmp_path, "wandb")


def test_cli_source_choices_come_from_the_table() -> None:
    assert SOURCES == ("auto", *(s.name for s in TABLE))
    assert len({s.priority for s in TABLE}) == len(TABLE)  # a tie would make detection order arbitrary
    options = [
        p for cmd in (verify_resume, report, compare) for p in cmd.params if p.name.startswith("source")
    ]
    assert len(options) == 4
    assert all(tuple(p.type.choices) == SOURCES for p in options)


def _read_losses_txt(path: Path, tags: object) -> Run:
    """A made-up format, ``STEP LOSS LR`` per line: what a new source module would contain."""
    files = [path] if path.is_file() else sorted(path.glob("*.losses.txt"))
    steps = []
    for line in files[0].read_text().splitlines():
        s, x, lr = line.split()
        steps.append(StepRecord(step=int(s), loss=float(x), lr=float(lr)))
    return Run(path=str(files[0]), source="losses", sessions=[Session(id="1", steps=steps)])


def test_a_source_added_to_the_table_is_detected_and_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = LogSource(
        name="losses",
        priority=len(TABLE),  # after every existing source
        file_patterns=("*.losses.txt",),
        probe=lambda d: any(d.glob("*.losses.txt")),
        looks_for="*.losses.txt",
        read=_read_losses_txt,
    )
    monkeypatch.setattr(sources, "TABLE", (*TABLE, new))
    path = tmp_path / "run.losses.txt"
    path.write_text("".join(f"{s} {x!r} {lr!r}\n" for s, x, lr in LOSSES))
    assert detect_source(tmp_path) == "losses" and detect_source(path) == "losses"
    assert [r.loss for r in load_run(tmp_path).sessions[0].steps] == [x for _, x, _ in LOSSES]
    _csv(tmp_path)  # a higher-priority log beside it wins
    assert detect_source(tmp_path) == "csv" and load_run(tmp_path, "losses").source == "losses"
    (tmp_path / "metrics.csv").unlink()
    path.unlink()
    with pytest.raises(RunInputError, match=r"TensorBoard events, CSV or \*\.losses\.txt in"):
        load_run(tmp_path)


def test_event_files_in_many_directories_are_refused_in_one_short_line(tmp_path: Path) -> None:
    """A folder above several TensorBoard runs (train/, eval/, other experiments) is refused naming a few of them,
    not every directory: the error stays one readable line however many runs sit below."""
    from torch.utils.tensorboard import SummaryWriter

    for i in range(6):
        with SummaryWriter(str(tmp_path / f"run{i}" / ("x" * 120))) as w:
            w.add_scalar("train/loss", 1.0, 1)
    with pytest.raises(RunInputError) as e:
        sources.load_run(tmp_path, "tensorboard")
    msg = str(e.value)
    assert "event files in 6 directories" in msg and "+3 more" in msg and "pass one of them" in msg
    assert "\n" not in msg and len(msg) < 1000
