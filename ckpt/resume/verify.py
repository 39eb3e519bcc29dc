"""Run every check at every boundary of a run and combine the verdicts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ckpt.resume.boundaries import Boundary, find_boundaries, suspected_boundaries
from ckpt.resume.checks import (
    ALL_CHECKS,
    Cause,
    CheckContext,
    CheckResult,
    Confidence,
    Status,
    VerifyOptions,
    worst,
)
from ckpt.resume.checks.saved import unchecked_without_overlap
from ckpt.resume.checks.scheduled import soften
from ckpt.resume.checks.weights import digests_of
from ckpt.resume.facts import FactsProvider
from ckpt.resume.model import Run

_VALUE_CHECKS = {"lr", "loss", "data", "position", "rng"}
"""The checks whose failure at a suspected boundary shows a discontinuity in the logged values."""
_LOSS_CAUSES = {
    Cause.LOSS_DIVERGED,
    Cause.MODEL_STATE,
    Cause.OPTIMIZER_LOST,
    Cause.LOSS_DROP,
    Cause.LOSS_SHIFT,
}
_NO_LOSS_EFFECT = {"lost_work", "env"}


@dataclass(slots=True)
class BoundaryVerdict:
    """All check results at one boundary and the root causes they name."""

    boundary: Boundary
    checks: list[CheckResult]
    deterministic: bool

    @property
    def status(self) -> Status:
        return worst([c.status for c in self.checks])

    @property
    def causes(self) -> list[Cause]:
        """Root causes (failures and warnings not explained by another check), in check order."""
        out: list[Cause] = []
        for c in self.checks:
            if (
                c.status in (Status.FAIL, Status.WARN)
                and c.cause
                and not c.explained_by
                and c.cause not in out
            ):
                out.append(c.cause)
        return out

    def check(self, name: str) -> CheckResult:
        return next(c for c in self.checks if c.name == name)


@dataclass(slots=True)
class Verification:
    """The verifier's answer for a run; ``exit_code`` is 0 when continuous (warnings allowed), 1 otherwise."""

    run: Run
    verdicts: list[BoundaryVerdict]
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> Status:
        return worst([v.status for v in self.verdicts]) if self.verdicts else Status.PASS

    @property
    def causes(self) -> list[Cause]:
        return [c for v in self.verdicts for c in v.causes]

    @property
    def exit_code(self) -> int:
        return 1 if self.status is Status.FAIL else 0

    @property
    def undecided(self) -> list[str]:
        """The checks that said "cannot tell" at some boundary (a warning naming what the logs cannot
        decide: :data:`Cause.CANNOT_TELL`, or the optimizer row on logs without its facts)."""
        names = [
            c.name
            for v in self.verdicts
            for c in v.checks
            if c.status is Status.WARN
            and (c.cause is Cause.CANNOT_TELL or (c.cause is None and c.name == "optimizer"))
        ]
        return list(dict.fromkeys(names))


def _deterministic(boundary: Boundary, options: VerifyOptions) -> bool:
    if options.deterministic is not None:
        return options.deterministic
    envs = [boundary.post.env] + ([boundary.dead.env] if boundary.dead else [])
    return all(env.get("deterministic") is True for env in envs)


def _attribute(results: list[CheckResult]) -> None:
    """A loss failure that another failing check explains (LR, data, RNG, steps, the checkpoint's counters)
    is a consequence, not a second cause.  Lost work and environment drift do not move the loss, so they
    explain nothing."""
    loss = next((r for r in results if r.name == "loss"), None)
    if loss is None or loss.status is not Status.FAIL:
        return
    others = [
        r.cause
        for r in results
        if r is not loss and r.status is Status.FAIL and r.cause and r.name not in _NO_LOSS_EFFECT
    ]
    if not others:
        return
    loss.explained_by = [c for c in dict.fromkeys(others) if c not in _LOSS_CAUSES] or others


def judge_boundary(
    run: Run,
    b: Boundary,
    checks: Sequence[Callable[[CheckContext], CheckResult]],
    *,
    options: VerifyOptions,
    facts: FactsProvider | None,
    lr_reference: dict[int, float] | None,
) -> BoundaryVerdict:
    """Run ``checks`` at boundary ``b``, with the facts of the checkpoint it restored, and attribute the loss.

    One place for both callers: :func:`verify_run` (a crash in the run's own log) and
    :func:`ckpt.resume.continuity.compare_to_reference` (a resume compared with another run's log).
    """
    det = _deterministic(b, options)
    f = facts(b.restored_step, b.restore.path if b.restore else None) if facts else None
    ctx = CheckContext(run, b, options, det, lr_reference=lr_reference, facts=f, weights=digests_of(facts))
    results = [check(ctx) for check in checks]
    _attribute(results)
    soften(results)
    return BoundaryVerdict(boundary=b, checks=results, deterministic=det)


def verify_run(
    run: Run,
    *,
    options: VerifyOptions | None = None,
    facts: FactsProvider | None = None,
    lr_reference: dict[int, float] | None = None,
) -> Verification:
    """Check every resume boundary of ``run``.

    ``facts`` supplies the restored checkpoint's own counters (see :mod:`ckpt.resume.facts`);
    ``lr_reference`` is a replayed schedule (:func:`ckpt.resume.replay.replay_lr`) used where the pre-crash
    log has no LR for a resumed step.
    """
    options = options or VerifyOptions()

    def judge(b: Boundary) -> BoundaryVerdict:
        return judge_boundary(run, b, ALL_CHECKS, options=options, facts=facts, lr_reference=lr_reference)

    boundaries = find_boundaries(run)
    verdicts = [judge(b) for b in boundaries]
    if not run.sessions_logged:
        failed = [v.boundary.restored_step for v in verdicts if v.status is Status.FAIL]
        for b in suspected_boundaries(run, boundaries):
            floor = max((n for n in failed if n < b.restored_step), default=None)
            if floor is not None:
                # After a discontinuity the run is a new lineage: judging later checkpoints against the
                # history before it would report the same restart again at every one of them.
                b.pre = {s: r for s, r in b.pre.items() if s > floor}
            v = judge(b)
            if any(
                c.name in _VALUE_CHECKS and c.status is Status.FAIL and c.confidence is not Confidence.LOW
                for c in v.checks
            ):
                b.index = len(verdicts) + 1
                verdicts.append(v)
                failed.append(b.restored_step)
    notes = list(run.notes)
    for v in verdicts:
        b = v.boundary
        if b.post.steps and not b.overlap:
            # a note, not a verdict: the exit code stays what the checks decided
            what = unchecked_without_overlap(v.checks, b.restored_step)
            notes.append(
                f"boundary {b.index} (restored step {b.restored_step}): no step was logged both before the crash and "
                f"after the resume, so it cannot check {'; '.join(what)}"
            )
    return Verification(run=run, verdicts=verdicts, notes=notes)
