"""Result types shared by every check, and the names of the causes a check can report."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Status(str, Enum):
    """Outcome of one check; ``skip`` means the log cannot answer it (no overlap, no digests, no events)."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


class Cause(str, Enum):
    """Named root causes.  Tests and users match on these, so the values are stable wording."""

    STEPS_SKIPPED = "steps skipped"
    STEPS_REPEATED = "steps repeated"
    WARMUP_RESTARTED = "scheduler not restored (warmup restarted)"
    LR_OFF_BY_ONE = "LR off by one (scheduler rebuilt with last_epoch / load order)"
    LR_DIFFERENT = "different LR schedule"
    OPTIMIZER_LOST = "optimizer state lost"
    """Named only from facts (checkpoint or restore-record counters, or bitwise in a run whose sessions recorded
    determinism: first loss exact, first update differs), never from the loss's shape (a lost state can move
    the loss either way) nor from ``--deterministic`` forced on a log that claims nothing."""
    MODEL_STATE = "model state not restored exactly"
    LOSS_DIVERGED = "loss differs from the pre-crash run"
    LOSS_DROP = "loss dropped after resume (repeated data?)"
    LOSS_SHIFT = "loss level shifted after restore"
    """The symptom, named when no fact says which state was lost (see the check's summary for what to check)."""
    DATA_POSITION_LOST = "data position lost"
    RNG_NOT_RESTORED = "RNG not restored"
    OLDER_CHECKPOINT = "resumed from an older checkpoint (lost work)"
    UNCOMMITTED_CHECKPOINT = "resumed from a checkpoint with no commit event"
    COUNTER_MISMATCH = "checkpoint counters disagree with the restored step"
    ENV_DRIFT = "environment changed"
    TOKENIZER_CHANGED = "tokenizer changed"
    LR_SHIFTED = "LR shifted by several steps"
    LR_FROZEN = "LR constant after resume where the schedule was moving (scheduler not stepping)"
    STATE_MISSING = "checkpoint lacks state the resume needs"
    WEIGHTS_NOT_RESTORED = "model weights not restored"
    STALE_CHECKPOINT = "checkpoint holds an earlier step's weights"
    NOT_REPRODUCIBLE = "run not reproducible even without a resume"
    OPTIMIZER_SETTINGS = "optimizer settings changed at resume"
    ACCUMULATION_CHANGED = "gradient accumulation changed at resume"
    CANNOT_TELL = "cannot tell from the logs"
    """A warning, never a failure: the loss or LR moved at the boundary where a scheduled change (a logged
    curriculum phase, an LR milestone, an epoch start) or a defect would both move it, and nothing logged
    decides which (docs/verify-resume.md, "Cannot tell")."""


class Basis(str, Enum):
    """What a verdict was judged against, strongest first: the same steps logged before the crash (or
    replayed), the counters and scheduler state stored in the restored checkpoint, or the run's own
    trajectory around the boundary when nothing overlaps."""

    OVERLAP = "overlap"
    REPLAY = "replayed schedule"
    CHECKPOINT = "checkpoint facts"
    TRAJECTORY = "trajectory"
    EVENTS = "events"


class Confidence(str, Enum):
    """How sure a verdict is: ``exact`` (equality of values that must be equal), ``high`` (far outside the
    run's own variation, or an exact repeat of an earlier stretch), ``low`` (near a threshold, or few points)."""

    EXACT = "exact"
    HIGH = "high"
    LOW = "low"


Number = int | float | str | bool | None

STATUS_RANK = {Status.SKIP: 0, Status.PASS: 1, Status.WARN: 2, Status.FAIL: 3}


@dataclass(slots=True)
class CheckResult:
    """One check at one boundary: the verdict, the named cause, a one-line reason and the deciding numbers.

    ``explained_by`` lists causes found by other checks that account for this failure (a loss that differs
    because the RNG was not restored), so the report names the root cause once instead of twice.
    """

    name: str
    status: Status
    summary: str
    cause: Cause | None = None
    numbers: dict[str, Number] = field(default_factory=dict)
    explained_by: list[Cause] = field(default_factory=list)
    basis: Basis | None = None
    confidence: Confidence | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "check": self.name,
            "status": self.status.value,
            "cause": self.cause.value if self.cause else None,
            "summary": self.summary,
            "numbers": self.numbers,
            "explained_by": [c.value for c in self.explained_by],
            "basis": self.basis.value if self.basis else None,
            "confidence": self.confidence.value if self.confidence else None,
        }

    def judged(self, basis: Basis, confidence: Confidence) -> CheckResult:
        """This result with what it was judged against and how sure it is (returns self, for chaining)."""
        self.basis, self.confidence = basis, confidence
        return self


def worst(statuses: list[Status]) -> Status:
    return max(statuses, key=STATUS_RANK.__getitem__, default=Status.SKIP)
