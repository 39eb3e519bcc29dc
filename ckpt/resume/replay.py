"""Replays: an LR schedule from the user's scheduler factory, and the user's training command itself.

``replay_lr`` gives the exact LR reference for LR continuity.  ``replay_command`` is the active mode of
``ckpt verify-resume RUN --replay CMD``: re-run training from one of RUN's checkpoints for a few steps into
a scratch ledger and compare with what RUN logged (see :mod:`ckpt.resume.continuity`).

The LR replay is useful when the pre-crash log does not cover the resumed steps (the crash came right after a save), or to
check the whole run against the schedule it was meant to follow.  The factory is called on a throwaway
one-parameter optimizer, so any ``torch.optim.lr_scheduler`` (``LambdaLR``, ``SequentialLR``, ...) works.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt.resume.errors import RunInputError
from ckpt.resume.verify import Verification
from ckpt.words import count


def replay_lr(scheduler_factory: Callable[[Any], Any], *, base_lr: float, steps: int) -> dict[int, float]:
    """LR used by each optimizer step ``1..steps`` (read before ``scheduler.step()``, as the ledger logs it).

    ``scheduler_factory(optimizer)`` must build the scheduler exactly as training does, for the full
    schedule length (a save run that builds a shorter schedule has a different LR for a reason that is not
    a bug).  ``base_lr`` is the optimizer's configured learning rate.
    """
    import torch

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=base_lr)
    scheduler = scheduler_factory(optimizer)
    out: dict[int, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()" is harmless here
        for step in range(1, steps + 1):
            out[step] = float(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    return out


# ------------------------------------------------------------------------------------------ active replay
PLACEHOLDERS = {
    "{checkpoint}": "path of the checkpoint to restore (RUN/checkpoints/step_XXXXXXXX)",
    "{step}": "its step N",
    "{steps}": "K, the number of steps to train after restoring",
    "{stop}": "N + K, the last step to train",
    "{run}": "a fresh scratch run directory for the replay's ledger and any checkpoints it writes",
    "{ledger}": "the ledger file the replay must write ({run}/ledger.jsonl)",
}
"""What ``--replay CMD`` substitutes (shell-quoted) before running CMD with the shell."""

DEFAULT_REPLAY_STEPS = 10


@dataclass
class ReplayOutcome:
    """The replay's verdict plus what was run, for the report."""

    verification: Verification
    command: str
    scratch: Path
    from_step: int
    steps: int
    notes: list[str] = field(default_factory=list)


def substitute(command: str, values: Mapping[str, object]) -> str:
    """Replace each ``{name}`` placeholder by its shell-quoted value.  Plain replacement, not ``str.format``,
    so the rest of a shell command (``${VAR}``, ``{a,b}``, JSON) passes through untouched."""
    for key, value in values.items():
        command = command.replace(key, shlex.quote(str(value)))
    return command


def replay_command(
    run_dir: str | os.PathLike[str],
    command: str,
    *,
    from_step: int | None = None,
    steps: int | None = None,
    checkpoints: str | None = None,
    scratch: str | os.PathLike[str] | None = None,
    options: Any = None,
    source: str = "auto",
    timeout: float | None = None,
) -> ReplayOutcome:
    """Re-run ``command`` from checkpoint ``from_step`` (default: the newest committed one that the log has
    steps after) for ``steps`` steps into a scratch ledger, and compare it step by step with RUN's log.

    Raises :class:`RunInputError` (exit 2) for an unusable run, checkpoint or command; the discontinuities
    found are in the returned verification (exit 1).
    """
    from ckpt.errors import CkptError
    from ckpt.restoring.discovery import list_checkpoints, step_dir
    from ckpt.resume.continuity import compare_to_reference, effective_history
    from ckpt.resume.ledger import checkpoints_dir, ledger_path
    from ckpt.resume.manifest_facts import ManifestFacts
    from ckpt.resume.sources import load_run, read_jsonl

    original = load_run(run_dir, source)
    root = str(checkpoints) if checkpoints else str(checkpoints_dir(run_dir))
    try:
        committed = [i.step for i in list_checkpoints(root) if i.status == "committed"]
    except (CkptError, OSError) as exc:
        raise RunInputError(f"cannot list checkpoints under {root}: {exc}") from None
    if not committed:
        raise RunInputError(f"no committed checkpoint under {root}; pass --checkpoints")
    history = effective_history(original)
    if from_step is None:
        usable = [s for s in committed if s + 1 in history]
        if not usable:
            raise RunInputError(f"no checkpoint under {root} has logged steps after it to compare with")
        from_step = usable[-1]
    elif from_step not in committed:
        have = ", ".join(map(str, committed[-8:]))
        raise RunInputError(f"no committed checkpoint of step {from_step} under {root} (have: {have})")
    logged_after = 0
    while from_step + logged_after + 1 in history:
        logged_after += 1
    notes: list[str] = []
    if steps is None:
        steps = max(1, min(DEFAULT_REPLAY_STEPS, logged_after))
    if steps < 1:
        raise RunInputError(f"--replay-steps must be at least 1, got {steps}")
    if steps > logged_after:
        notes.append(
            f"the run logged only {count(logged_after, 'step')} after {from_step}: the rest is not compared"
        )
    work = Path(scratch) if scratch else Path(tempfile.mkdtemp(prefix="ckpt-replay-"))
    work.mkdir(parents=True, exist_ok=True)
    ledger = ledger_path(work)
    if ledger.exists() and ledger.stat().st_size:
        raise RunInputError(f"{ledger} already exists: pass an empty --scratch directory")
    values = {
        "{checkpoint}": f"{root}/{step_dir(from_step)}",
        "{step}": from_step,
        "{steps}": steps,
        "{stop}": from_step + steps,
        "{run}": work,
        "{ledger}": ledger,
    }
    cmd = substitute(command, values)
    try:
        proc = subprocess.run(cmd, shell=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise RunInputError(f"replay command did not finish within {timeout} s: {cmd}") from None
    if proc.returncode != 0:
        raise RunInputError(f"replay command exited with code {proc.returncode}: {cmd}")
    if not ledger.exists():
        raise RunInputError(f"replay command wrote no ledger at {ledger}; give it {{run}} or {{ledger}}")
    replayed = read_jsonl(ledger)
    for session in replayed.sessions:
        session.steps = [r for r in session.steps if r.step <= from_step + steps]
    facts = ManifestFacts(root)
    verification = compare_to_reference(
        original,
        replayed,
        from_step,
        restore_path=str(values["{checkpoint}"]),
        facts=facts,
        options=options,
    )
    verification.notes.extend(notes + facts.notes)
    return ReplayOutcome(verification, cmd, work, from_step, steps, verification.notes)
