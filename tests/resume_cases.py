"""The example trainer's resume defects (fixtures/resume) in every log format the verifier reads.

The fixtures hold the ledger the real trainer wrote and its checkpoints' facts; the other formats are written
here from the ledger the way each tool writes them:

- ``tensorboard``: one event file per session (float32 scalars ``train/loss``, ``train/lr``,
  ``train/grad_norm``, ``train/samples``), the resumed writer purging from its first step;
- ``csv``: one row per step with a ``session`` column and the digests, full precision;
- ``hf``: what the Trainer leaves: ``trainer_state.json`` of the output dir and of every ``checkpoint-N`` (its
  ``log_history`` up to N, the loss rounded to 4 decimals as the Trainer does).  ``log_history`` lives in the
  process, so the steps a killed process logged after its last checkpoint die with it.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from ckpt.resume.facts import CheckpointFacts, FactsProvider
from ckpt.resume.model import Run, Save
from ckpt.resume.sources import read_jsonl

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "resume"
FORMATS = ("ledger", "tensorboard", "csv", "hf")


def case_dir(mode: str, defect: str) -> Path:
    return FIXTURES / mode / defect


def facts_of(mode: str, defect: str) -> FactsProvider:
    doc = json.loads((case_dir(mode, defect) / "facts.json").read_text())
    table = {
        int(k): CheckpointFacts(**{**v, "missing": tuple(v.get("missing") or ())}) for k, v in doc.items()
    }
    return lambda step, path: table.get(step)


def ledger_run(mode: str, defect: str) -> Run:
    return read_jsonl(case_dir(mode, defect) / "ledger.jsonl")


def write_tensorboard(run: Run, logdir: Path) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    for i, session in enumerate(run.sessions):
        w = SummaryWriter(str(logdir), purge_step=session.steps[0].step if i else None)
        for r in session.steps:
            w.add_scalar("train/loss", r.loss, r.step)
            w.add_scalar("train/lr", r.lr, r.step)
            w.add_scalar("train/grad_norm", r.grad_norm, r.step)
            w.add_scalar("train/samples", r.samples, r.step)
        w.close()
    return logdir


def write_csv(run: Run, path: Path, *, sessions: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = ["step", "loss", "lr", "grad_norm", "samples", "data_digest", "rng_digest"]
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols + (["session"] if sessions else []))
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
                ]
                w.writerow(row + ([s.id] if sessions else []))
    return path


def _entry(r) -> dict[str, object]:
    return {"step": r.step, "loss": round(r.loss, 4), "learning_rate": r.lr, "grad_norm": r.grad_norm}


def write_hf(run: Run, out: Path) -> Path:
    """The Trainer's output dir: each session's ``log_history`` continues the restored checkpoint's, and each
    save writes a ``checkpoint-N`` with the history so far; the last session's history is the output dir's."""
    out.mkdir(parents=True, exist_ok=True)
    history: list[dict[str, object]] = []
    for session in run.sessions:
        restored = session.restores[0].step if session.restores else 0
        if session.restores:
            ck = out / f"checkpoint-{restored}" / "trainer_state.json"
            history = json.loads(ck.read_text())["log_history"] if ck.is_file() else []
        saves = {e.step for e in session.events if isinstance(e, Save)}
        for r in session.steps:
            history.append(_entry(r))
            if r.step in saves:
                d = out / f"checkpoint-{r.step}"
                d.mkdir(exist_ok=True)
                state = {"global_step": r.step, "log_history": history}
                (d / "trainer_state.json").write_text(json.dumps(state))
    (out / "trainer_state.json").write_text(
        json.dumps({"global_step": history[-1]["step"], "log_history": history})
    )
    return out


def write_format(run: Run, fmt: str, dest: Path) -> Path:
    """``run`` (a ledger's) written as ``fmt``; returns what ``load_run`` should be given."""
    if fmt == "ledger":
        return Path(run.path)
    if fmt == "tensorboard":
        return write_tensorboard(run, dest / "tb")
    if fmt == "csv":
        return write_csv(run, dest / "csv" / "metrics.csv")
    if fmt == "hf":
        return write_hf(run, dest / "hf")
    raise ValueError(fmt)
