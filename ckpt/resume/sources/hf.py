"""Read Hugging Face Trainer ``trainer_state.json`` files (the output dir's and each ``checkpoint-*``'s).

The Trainer keeps no session marker: on resume it reloads ``log_history`` from the checkpoint and keeps
appending, then overwrites the output dir's copy.  Pre-crash entries survive only in checkpoints the dead
process wrote after the one the next process restored.  So each file is a *lineage*; a lineage that disagrees
with the final one at a common step (or reaches past it) is a dead session, and the restore point of the
next session is inferred as the last checkpoint on which both agree (recorded as ``Restore(inferred=True)``).
Two more traces mark a resume inside one lineage (:mod:`ckpt.resume.sources.hf_traces`): a position field
(``epoch``, ``num_input_tokens_seen``) that goes back, and the final summary entry, whose
``train_steps_per_second * train_runtime`` counts the steps the last ``train()`` call ran.  A dir with none of
these traces says so in a note: a resume that reproduced every logged value and left no summary is invisible.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ckpt.resume.errors import RunInputError
from ckpt.resume.model import Restore, Run, Save, Session, StepRecord
from ckpt.resume.sources.base import LogSource, is_phase_name, phase_text
from ckpt.resume.sources.hf_traces import no_trace, place, restart_from_summary, restarts_from_positions

_CKPT_RE = re.compile(r"checkpoint-(\d+)$")


def _load(path: Path) -> list[StepRecord]:
    try:
        return _records(_state(path))
    except (ValueError, KeyError, TypeError) as exc:
        raise RunInputError(f"{path}: not a Trainer state file ({type(exc).__name__}: {exc})") from None


def _state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or not isinstance(state["log_history"], list):
            raise TypeError("log_history is not a list")
        return state
    except FileNotFoundError:
        raise RunInputError(f"no trainer_state.json at {path}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise RunInputError(f"{path}: not a Trainer state file ({type(exc).__name__}: {exc})") from None


def _records(state: dict[str, Any]) -> list[StepRecord]:
    """The training-loss entries of ``log_history``, with the position fields the Trainer logs beside them
    (``epoch``, ``num_input_tokens_seen``) and the phase metrics a callback logged at the same step."""
    history = state["log_history"]
    phases: dict[int, dict[str, object]] = {}
    for entry in history:
        if isinstance(entry, dict) and "step" in entry:
            found = {k: v for k, v in entry.items() if is_phase_name(k) and isinstance(v, (int, float, str))}
            phases.setdefault(int(entry["step"]), {}).update(found)
    recs = []
    for entry in history:
        if "loss" not in entry or "step" not in entry:
            continue  # eval / final summary entries
        step = int(entry["step"])
        recs.append(
            StepRecord(
                step=step,
                loss=float(entry["loss"]),
                lr=_float(entry.get("learning_rate")),
                grad_norm=_float(entry.get("grad_norm")),
                tokens=None
                if entry.get("num_input_tokens_seen") is None
                else int(entry["num_input_tokens_seen"]),
                epoch=_float(entry.get("epoch")),
                phase=phase_text(phases.get(step, {})),
            )
        )
    return recs


def _float(v: object) -> float | None:
    return None if v is None else float(v)  # type: ignore[arg-type]


def _same(a: StepRecord, b: StepRecord) -> bool:
    return (a.loss, a.lr, a.grad_norm, a.epoch, a.tokens) == (b.loss, b.lr, b.grad_norm, b.epoch, b.tokens)


def _agree_until(a: dict[int, StepRecord], b: dict[int, StepRecord]) -> int | None:
    """First common step where lineages differ, or None if they agree on every common step."""
    for step in sorted(a.keys() & b.keys()):
        if not _same(a[step], b[step]):
            return step
    return None


def read_hf(path: str | os.PathLike[str]) -> Run:
    """A run from an HF output dir (or one ``trainer_state.json``); see the module docstring for sessions."""
    p = Path(path)
    if p.is_file():
        files = [p]
        root: Path | None = p
        base = p.parent
    else:
        base = p
        root = p / "trainer_state.json" if (p / "trainer_state.json").is_file() else None
        files = [d / "trainer_state.json" for d in p.iterdir() if _CKPT_RE.search(d.name)]
        files = [f for f in files if f.is_file()] + ([root] if root else [])
    if not files:
        raise RunInputError(f"no trainer_state.json under {p}")
    ckpt_steps = sorted(int(m.group(1)) for d in base.iterdir() if (m := _CKPT_RE.search(d.name)))
    lineages = {f: _load(f) for f in files}
    by_step = {f: {r.step: r for r in recs} for f, recs in lineages.items()}
    main = root or max(files, key=lambda f: max(by_step[f], default=-1))
    run = Run(path=str(p), source="hf", precision="rounded", sessions_logged=False)
    # Dead lineages: disagree with the main one at a common step, or reach past its end.
    dead = []
    main_last = max(by_step[main], default=-1)
    for f in files:
        if f == main or not by_step[f]:
            continue
        diverge = _agree_until(by_step[f], by_step[main])
        if diverge is None and max(by_step[f]) <= main_last:
            continue
        if diverge is None:
            diverge = min(s for s in by_step[f] if s > main_last)
        dead.append((diverge, f))
    dead.sort(key=lambda t: (t[0], str(t[1])))
    kept: list[tuple[int, Path]] = []
    for d, f in dead:  # lineages that are prefixes of a longer dead one add nothing
        if any(_agree_until(by_step[f], by_step[g]) is None and d == d2 for d2, g in kept):
            continue
        kept.append((d, f))
    chain = [f for _, f in kept] + [main]
    ckpt_files = {int(m.group(1)): f for f in files if (m := _CKPT_RE.search(f.parent.name))}
    assigned: set[int] = set()
    prev: dict[int, StepRecord] | None = None
    for f in chain:
        recs = lineages[f]
        session = Session(id=str(f.parent.name if f != root else "final"), origin=str(f))
        if prev is not None:
            diverge = _agree_until(by_step[f], prev)
            first_new = (
                diverge if diverge is not None else min((s for s in by_step[f] if s not in prev), default=0)
            )
            agreed = [s for s in ckpt_steps if s < first_new]
            restored = max(agreed) if agreed else max((s for s in by_step[f] if s < first_new), default=0)
            session.add_event(Restore(time=None, step=restored, path=f"checkpoint-{restored}", inferred=True))
            recs = [r for r in recs if r.step > restored]
            run.notes.append(f"{session.id}: restore of step {restored} inferred (Trainer logs no restores)")
        session.steps.extend(recs)
        # Checkpoint dirs whose history agrees with this lineage were (most likely) saved by this session.
        for step, cf in sorted(ckpt_files.items()):
            last = recs[-1].step if recs else -1
            if step in assigned or step > last or (recs and step < recs[0].step and prev is not None):
                continue
            if _agree_until(by_step[cf], by_step[f]) is None:
                place(session, Save(time=None, step=step, path=str(cf.parent)), step)
                assigned.add(step)
        run.sessions.append(session)
        prev = by_step[f]
    if not any(s.steps for s in run.sessions):
        raise RunInputError(f"no training loss entries in log_history under {p}")
    for session in run.sessions:
        restarts_from_positions(session, ckpt_steps, run.notes)
    if root is not None and run.sessions:
        restart_from_summary(_state(root), run.sessions[-1], ckpt_steps, run.notes)
    if not any(s.restores for s in run.sessions):
        run.notes.append(no_trace(run))
    return run


def _probe(d: Path) -> bool:
    return (d / "trainer_state.json").is_file() or any(d.glob("checkpoint-*/trainer_state.json"))


SOURCE = LogSource(
    name="hf",
    priority=1,
    file_patterns=("trainer_state.json",),
    probe=_probe,
    looks_for="trainer_state.json",
    read=lambda path, tags: read_hf(path),
)
