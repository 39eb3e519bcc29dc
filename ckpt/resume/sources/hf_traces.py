"""Traces of a resume inside one Trainer ``log_history``, beside the dead lineages :mod:`.hf` finds.

The Trainer logs no restore, and a resumed process's ``log_history`` continues the restored checkpoint's, so
a resume whose pre-crash steps died with the process leaves one seamless lineage.  Two fields still show it:

- a *position* field that goes back: ``epoch`` and ``num_input_tokens_seen`` only grow in one process, so a
  step logged with a smaller value than the step before it was trained by a process that restarted from a
  checkpoint (with ``ignore_data_skip=True`` the epoch restarts at the checkpoint's epoch: 1.375 -> 1.031);
- the *final summary* entry (``train_runtime``, ``train_steps_per_second``; written when the user saves the
  state after ``train()``): their product is the number of steps the last ``train()`` call ran (transformers
  >= 4.50 counts the steps of that call; older versions count ``max_steps``, which points at step 0 and so
  adds nothing), so the call began after ``global_step`` minus that number, at one of the run's checkpoints.

Each trace becomes an inferred :class:`~ckpt.resume.model.Restore` placed among the session's steps, and a
note says which trace it came from.
"""

from __future__ import annotations

from typing import Any

from ckpt.resume.model import Event, Restore, Run, Session

_POSITIONS = (("epoch", "epoch"), ("tokens", "num_input_tokens_seen"))


def place_at(session: Session, event: Event, pos: int) -> None:
    """Insert ``event`` so that ``pos`` step records precede it, keeping events ordered by position."""
    i = sum(1 for p in session.event_positions if p <= pos)
    session.events.insert(i, event)
    session.event_positions.insert(i, pos)


def place(session: Session, event: Event, after_step: int) -> None:
    """Insert ``event`` right after the last step record of ``session`` at or before ``after_step``."""
    place_at(session, event, sum(1 for r in session.steps if r.step <= after_step))


def _restore_point(first_step: int, ckpt_steps: list[int]) -> tuple[int, str]:
    """(N, path): the newest checkpoint before ``first_step`` (a Trainer resumes only from one)."""
    older = [c for c in ckpt_steps if c < first_step]
    n = max(older) if older else first_step - 1
    return n, f"checkpoint-{n}"


def restarts_from_positions(session: Session, ckpt_steps: list[int], notes: list[str]) -> None:
    """An inferred restore wherever ``epoch`` or ``num_input_tokens_seen`` goes back inside ``session``."""
    steps = session.steps
    taken = {
        p for p, e in zip(session.event_positions, session.events, strict=True) if isinstance(e, Restore)
    }
    for i in range(1, len(steps)):
        a, b = steps[i - 1], steps[i]
        for attr, name in _POSITIONS:
            x, y = getattr(a, attr), getattr(b, attr)
            if x is None or y is None or y >= x or i in taken:
                continue
            n, path = _restore_point(b.step, ckpt_steps)
            place_at(session, Restore(time=None, step=n, path=path, inferred=True), i)
            taken.add(i)
            notes.append(
                f"{session.id}: {name} went back from {x} at step {a.step} to {y} at step {b.step}: "
                f"a process resumed there (restore of step {n} inferred)"
            )


def _summary(state: dict[str, Any]) -> dict[str, Any] | None:
    entries = [e for e in state.get("log_history") or () if isinstance(e, dict)]
    for e in reversed(entries):
        if all(
            isinstance(e.get(k), (int, float)) for k in ("train_runtime", "train_steps_per_second", "step")
        ):
            return e
    return None


def restart_from_summary(
    state: dict[str, Any], session: Session, ckpt_steps: list[int], notes: list[str]
) -> None:
    """An inferred restore at the checkpoint where the last ``train()`` call began, from its summary entry.

    ``speed_metrics`` rounds the runtime to 4 decimals and the rate to 3, so the step count is known to within
    ``5e-4 * runtime + 5e-5 * rate`` (plus half a step); it must single out one checkpoint."""
    entry = _summary(state)
    if entry is None or not session.steps:
        return
    runtime, rate, last = (
        float(entry["train_runtime"]),
        float(entry["train_steps_per_second"]),
        int(entry["step"]),
    )
    ran = runtime * rate
    slack = 5e-4 * runtime + 5e-5 * rate + 0.5
    start = last - ran
    if start <= slack:
        notes.append(
            f"final summary: the last train() call ran all {last} steps ({ran:.1f} = rate x runtime)"
        )
        return
    near = [c for c in ckpt_steps if abs(c - start) <= slack and c < last]
    if len(near) != 1:
        notes.append(
            f"final summary: the last train() call ran {ran:.1f} steps, so it began near step {start:.1f}, "
            f"which {'matches no' if not near else 'matches more than one'} checkpoint: not used"
        )
        return
    n = near[0]
    restores = [e for e in session.events if isinstance(e, Restore)]
    if any(r.step == n for r in restores):
        return
    if restores:
        notes.append(
            f"final summary points at checkpoint-{n}, the logs at step {restores[-1].step}: not used"
        )
        return
    place(session, Restore(time=None, step=n, path=f"checkpoint-{n}", inferred=True), n)
    notes.append(
        f"{session.id}: the final summary says the last train() call ran {ran:.1f} steps up to step {last}: "
        f"it resumed from checkpoint-{n} (restore inferred)"
    )


def no_trace(run: Run) -> str:
    """The note for an output dir in which nothing shows a resume."""
    return (
        "no trace of a resume in this Trainer output dir: every checkpoint's log_history agrees with the final "
        "one, no epoch or num_input_tokens_seen goes back, and no final summary shows a later start "
        "(a resume that reproduced every logged value is invisible here)"
    )
