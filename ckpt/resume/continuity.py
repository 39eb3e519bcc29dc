"""Compare a resumed run against a reference, and a pytest helper that makes both runs.

A *reference comparison* is a resume boundary whose crash never happened: the resumed steps (``post``) are
checked against steps logged by another run (``pre``) with the same checks as ``verify-resume``, so the
verdict names the same causes.  Two users:

- ``ckpt verify-resume RUN --replay CMD`` (:mod:`ckpt.resume.replay`): the reference is RUN's own log, the
  resumed steps come from re-running the user's command from one of RUN's checkpoints.
- :func:`check_continuation`, for test suites: N steps straight vs K steps + save + restore in a fresh
  process + N-K steps, all in fresh processes so nothing survives in memory that a real restart would lose.

Example (a pytest test; ``train`` must be a module-level function so a fresh process can import it)::

    from ckpt.resume.continuity import Continuation, check_continuation

    def train(c: Continuation) -> None:
        torch.manual_seed(0)
        model, opt, sched, loader = build(total_steps=c.total_steps)
        start = c.restore(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
        for step in range(start, c.stop_at + 1):
            rng = digest_rng()
            ids, batch = loader.next()
            loss = train_step(model, opt, batch)
            c.ledger.step(step, loss, opt.param_groups[0]["lr"], data_digest=digest_ids(ids), rng_digest=rng)
            sched.step()
            c.save_if_due(step, model=model, optimizer=opt, scheduler=sched, dataloader=loader)

    def test_resume_is_exact(tmp_path):
        check_continuation(train, steps=12, split=5, workdir=tmp_path).assert_continuous()
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import shutil
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt.errors import CkptError
from ckpt.resume.boundaries import Boundary, segments
from ckpt.resume.checks import ALL_CHECKS, Cause, Status, VerifyOptions, check_lost_work
from ckpt.resume.facts import FactsProvider
from ckpt.resume.model import Restore, Run, Save, StepRecord
from ckpt.resume.verify import BoundaryVerdict, Verification, judge_boundary

REFERENCE_CHECKS = tuple(c for c in ALL_CHECKS if c is not check_lost_work)
"""Lost work needs a crash and the saves before it; a reference comparison has neither."""


class ContinuationError(CkptError):
    """The training function failed in one of the processes of a continuation check."""

    exit_code = 2

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def effective_history(run: Run) -> dict[int, StepRecord]:
    """For every step, the record of the latest segment that logged it: what the run finally trained."""
    history: dict[int, StepRecord] = {}
    for seg in segments(run):
        for r in seg.steps:
            history[r.step] = r
    return history


def compare_to_reference(
    reference: Run,
    resumed: Run,
    restored_step: int,
    *,
    restore_path: str | None = None,
    facts: FactsProvider | None = None,
    options: VerifyOptions | None = None,
    lr_reference: dict[int, float] | None = None,
) -> Verification:
    """Check the steps ``resumed`` logged after ``restored_step`` against ``reference``'s effective history.

    The resumed run's own restore event is used when it logged one (so a command that ignored the requested
    checkpoint is caught by the step check); otherwise the restore of ``restored_step`` is taken as given.
    """
    options = options or VerifyOptions()
    segs = [s for s in segments(resumed) if s.steps]
    if not segs:
        raise ContinuationError(f"{resumed.path}: the resumed run logged no steps")
    post = next((s for s in segs if s.restore is not None), segs[-1])
    restore = post.restore or Restore(time=None, step=restored_step, path=restore_path)
    pre = effective_history(reference)
    ref_segs = [s for s in segments(reference) if s.steps]
    saves: list[Save] = [e for s in ref_segs for e in s.saves]
    boundary = Boundary(
        index=1,
        post=post,
        dead=ref_segs[-1] if ref_segs else None,
        pre=pre,
        restored_step=restore.step,
        restore=restore,
        reason="reference comparison",
        newest_save=None,
        saved_steps=frozenset(s.step for s in saves),
    )
    verdict = judge_boundary(
        resumed, boundary, REFERENCE_CHECKS, options=options, facts=facts, lr_reference=lr_reference
    )
    return Verification(run=resumed, verdicts=[verdict])


def step_rows(verdict: BoundaryVerdict) -> list[dict[str, Any]]:
    """Step-by-step comparison of the resumed steps with the reference: values and equality per field."""
    rows = []
    pre = verdict.boundary.pre
    for r in verdict.boundary.post.steps:
        ref = pre.get(r.step)
        row: dict[str, Any] = {"step": r.step, "in_reference": ref is not None}
        for key in ("loss", "lr", "grad_norm", "samples", "data_digest", "rng_digest"):
            got = getattr(r, key)
            want = getattr(ref, key) if ref is not None else None
            row[key] = got
            row[f"reference_{key}"] = want
            row[f"{key}_equal"] = None if got is None or want is None else got == want
        rows.append(row)
    return rows


def render_rows(rows: list[dict[str, Any]]) -> str:
    """A plain-text step table (loss / LR / digests: reference vs resumed, ``=`` when bit-identical)."""
    out = io.StringIO()
    out.write(f"{'step':>6}  {'reference loss':>22}  {'resumed loss':>22}  loss  lr  data  rng\n")
    mark = {True: "=", False: "X", None: "-"}
    for r in rows:
        ref = "" if r["reference_loss"] is None else repr(r["reference_loss"])
        got = "" if r["loss"] is None else repr(r["loss"])
        out.write(
            f"{r['step']:>6}  {ref:>22}  {got:>22}  {mark[r['loss_equal']]:>4}  {mark[r['lr_equal']]:>2}"
            f"  {mark[r['data_digest_equal']]:>4}  {mark[r['rng_digest_equal']]:>3}\n"
        )
    return out.getvalue()


# ---------------------------------------------------------------------------------------- the pytest helper
@dataclass
class Continuation:
    """What the training function gets in each process: where to log, what to restore, when to stop and save.

    ``total_steps`` is the full schedule length in every process (a shorter schedule in the split run would
    change the LR for a reason that is not a resume bug).  ``ledger`` and ``manager`` are ready to use and
    closed by the harness; the manager logs its save and restore events into the ledger itself.
    """

    run_dir: Path
    total_steps: int
    stop_at: int
    save_at: int | None
    resume: bool
    ledger: Any
    manager: Any

    def restore(self, **state: Any) -> int:
        """Restore ``state`` from the newest checkpoint when this process resumes; returns the first step."""
        if not self.resume:
            return 1
        step = self.manager.restore_latest(**state)
        if step is None:
            raise ContinuationError(f"{self.manager.root}: no checkpoint to resume from")
        return step + 1

    def save_if_due(self, step: int, **state: Any) -> None:
        """Save ``state`` (and ``progress=``) synchronously when ``step`` is the split step."""
        if step == self.save_at:
            self.manager.save(step, **state)
            self.manager.wait()


@dataclass
class ContinuationResult:
    """The verdict of :func:`check_continuation`: resumed steps K+1..N against the straight run."""

    verification: Verification
    straight: Run
    split: Run
    split_at: int
    baseline_mismatch: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> BoundaryVerdict:
        return self.verification.verdicts[0]

    @property
    def ok(self) -> bool:
        return self.baseline_mismatch is None and self.verification.status is not Status.FAIL

    @property
    def causes(self) -> list[Any]:
        """The resume's causes; when the run is not reproducible even without a resume, only that (the
        resumed steps then differ from the straight run for reasons that are not the resume's)."""
        if self.baseline_mismatch is not None:
            return [Cause.NOT_REPRODUCIBLE]
        return self.verdict.causes

    def report(self) -> str:
        """Plain text: the checks, then the step table; what an assertion message should show."""
        from ckpt.resume.report import render_text

        text = render_text(self.verification)
        if self.baseline_mismatch is not None:
            text = (
                f"not reproducible without a resume: step {self.baseline_mismatch} differs between the straight "
                f"run and the first {self.split_at} steps of the split run (seed everything, or pass "
                "deterministic=False); the checks below compare with a run that is not a reference\n" + text
            )
        return text + render_rows(step_rows(self.verdict)) + "".join(f"note: {n}\n" for n in self.notes)

    def assert_continuous(self) -> None:
        """Raise AssertionError with :meth:`report` unless the resumed steps continue the straight run."""
        if not self.ok:
            raise AssertionError("resume is not continuous:\n" + self.report())


def _child(train_fn: Callable[[Continuation], None], spec: dict[str, Any], errq: Any) -> None:
    """One fresh process: ledger + manager around the user's function, errors sent back as text."""
    try:
        from ckpt.manager import CheckpointManager
        from ckpt.resume.ledger import LedgerWriter, checkpoints_dir

        run_dir = Path(spec["run_dir"])
        with LedgerWriter(run_dir, world_size=1, deterministic=spec["deterministic"]) as ledger:
            mgr = CheckpointManager(str(checkpoints_dir(run_dir)), async_save=False, on_event=ledger.on_event)
            try:
                train_fn(
                    Continuation(
                        run_dir=run_dir,
                        total_steps=spec["total_steps"],
                        stop_at=spec["stop_at"],
                        save_at=spec["save_at"],
                        resume=spec["resume"],
                        ledger=ledger,
                        manager=mgr,
                    )
                )
            finally:
                mgr.close()
        errq.put(None)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, which raises
        errq.put(traceback.format_exc())


def _start(ctx: Any, train_fn: Callable[[Continuation], None], spec: dict[str, Any], phase: str) -> Any:
    errq = ctx.Queue()
    proc = ctx.Process(target=_child, args=(train_fn, spec, errq), name=f"ckpt-continuation-{phase}")
    proc.start()
    return proc, errq


def _join(proc: Any, errq: Any, timeout: float, phase: str) -> None:
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise ContinuationError(f"the {phase} process did not finish within {timeout:.0f} s")
    try:
        err = errq.get(timeout=5)
    except Exception:  # noqa: BLE001 - queue.Empty: the process died without reporting
        err = f"process exited with code {proc.exitcode} before reporting"
    if err:
        last = err.strip().splitlines()[-1]
        raise ContinuationError(f"train_fn failed in the {phase} process: {last}", err)


def _first_unreproduced(
    first: list[StepRecord], ref: dict[int, StepRecord], deterministic: bool
) -> int | None:
    """The first step the split run's first half (no resume yet) logged differently from the straight run:
    RNG and batch digests always (they do not depend on floating point), loss and LR when deterministic."""
    fields = ("rng_digest", "data_digest", "lr") + (("loss",) if deterministic else ())
    for r in first:
        want = ref.get(r.step)
        if want is None:
            continue
        for key in fields:
            a, b = getattr(r, key), getattr(want, key)
            if a is not None and b is not None and a != b:
                return r.step
    return None


def check_continuation(
    train_fn: Callable[[Continuation], None],
    *,
    steps: int,
    split: int,
    workdir: str | os.PathLike[str],
    deterministic: bool = True,
    options: VerifyOptions | None = None,
    timeout: float = 600.0,
) -> ContinuationResult:
    """Run ``train_fn`` N=``steps`` steps straight, and K=``split`` steps + save + (fresh process) restore +
    N-K steps; compare the resumed steps with the straight run's, step by step.

    Each run is a fresh ``spawn`` process, so state that a real restart loses (module globals, RNG streams,
    a loader's iterator) is lost here too.  ``train_fn`` must be importable by name (defined at module level).
    With ``deterministic`` the losses must match bit for bit; otherwise within the noise calibrated on the
    straight run.  Runs are kept under ``workdir`` (``straight/``, ``split/``) for inspection.
    """
    if not 0 < split < steps:
        raise ContinuationError(f"split={split} must lie strictly between 0 and steps={steps}")
    work = Path(workdir)
    straight_dir, split_dir = work / "straight", work / "split"
    # These two folders are this harness's own output, kept for inspection until the next call: a second call
    # with the same workdir starts them afresh (the manager would refuse to overwrite a checkpoint).
    for old in (straight_dir, split_dir):
        if old.exists():
            shutil.rmtree(old)
    base = {"total_steps": steps, "deterministic": deterministic}
    ctx = mp.get_context("spawn")
    # The straight run and the first half of the split run are independent: run them side by side.
    a = _start(
        ctx,
        train_fn,
        {**base, "run_dir": str(straight_dir), "stop_at": steps, "save_at": None, "resume": False},
        "straight",
    )
    b = _start(
        ctx,
        train_fn,
        {**base, "run_dir": str(split_dir), "stop_at": split, "save_at": split, "resume": False},
        "split",
    )
    errors = []
    for proc, phase in ((a, "straight"), (b, "split (first half)")):
        try:
            _join(*proc, timeout, phase)  # join both before raising: never leave a process running
        except ContinuationError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    c = _start(
        ctx,
        train_fn,
        {**base, "run_dir": str(split_dir), "stop_at": steps, "save_at": None, "resume": True},
        "resume",
    )
    _join(*c, timeout, "resumed")

    from ckpt.resume.ledger import checkpoints_dir, ledger_path
    from ckpt.resume.manifest_facts import ManifestFacts
    from ckpt.resume.sources import read_jsonl

    straight = read_jsonl(ledger_path(straight_dir))
    split_run = read_jsonl(ledger_path(split_dir))
    facts = ManifestFacts(checkpoints_dir(split_dir))
    resumed = Run(path=split_run.path, source="jsonl", sessions=split_run.sessions[1:])
    options = options or VerifyOptions(deterministic=deterministic)
    verification = compare_to_reference(straight, resumed, split, facts=facts, options=options)
    ref = effective_history(straight)
    baseline = _first_unreproduced(split_run.sessions[0].steps, ref, deterministic)
    return ContinuationResult(
        verification=verification,
        straight=straight,
        split=split_run,
        split_at=split,
        baseline_mismatch=baseline,
        notes=list(facts.notes),
    )
