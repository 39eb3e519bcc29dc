"""What each failure cost: steps recomputed, downtime, restore and compile time, and what saving cost.

All numbers come from the ledger's timestamps and events; a log without them (CSV, HF) gives steps only.
Downtime runs from the dead segment's last record (the best available crash time) to the first step the
resumed segment logged, so it includes scheduling, start-up, restore and compilation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ckpt.resume.boundaries import find_boundaries, segments
from ckpt.resume.checks.stats import median
from ckpt.resume.model import Compile, Run


@dataclass(frozen=True, slots=True)
class FailureCost:
    boundary: int
    session: str
    crash_step: int | None
    restored_step: int
    steps_recomputed: int
    downtime_seconds: float | None
    restore_seconds: float | None
    compile_seconds: float
    compile_events: int
    recompute_seconds: float | None
    """Steps recomputed times the median step time: the training time the failure threw away."""
    tier: str | None = None
    """Where the restore read the state: ``local``, ``peer``, ``persistent`` (ckpt.tiers); None: not logged."""


@dataclass(frozen=True, slots=True)
class TierCost:
    """Recovery priced per tier: failures restored from it, and their mean restore time, downtime, steps lost."""

    tier: str
    failures: int
    restore_seconds: float | None
    downtime_seconds: float | None
    steps_recomputed: float


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def tier_costs(failures: list[FailureCost]) -> list[TierCost]:
    """One :class:`TierCost` per tier that served a restore (``unknown`` for restores that logged none)."""
    by: dict[str, list[FailureCost]] = {}
    for f in failures:
        by.setdefault(f.tier or "unknown", []).append(f)
    order = {"local": 0, "peer": 1, "persistent": 2}
    return [
        TierCost(
            tier,
            len(fs),
            _mean([f.restore_seconds for f in fs]),
            _mean([f.downtime_seconds for f in fs]),
            sum(f.steps_recomputed for f in fs) / len(fs),
        )
        for tier, fs in sorted(by.items(), key=lambda kv: (order.get(kv[0], 3), kv[0]))
    ]


@dataclass(frozen=True, slots=True)
class RunCost:
    failures: list[FailureCost]
    saves: int
    save_blocking_seconds: float
    save_background_seconds: float
    save_bytes: int
    compile_events: int
    compile_seconds: float
    median_step_seconds: float | None
    tiers: list[TierCost]

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def _median_step_seconds(run: Run) -> float | None:
    gaps = []
    for s in run.sessions:
        times = [r.time for r in s.steps if r.time is not None]
        gaps.extend(b - a for a, b in zip(times, times[1:], strict=False) if b > a)
    return median(gaps) if gaps else None


def recovery_cost(run: Run) -> RunCost:
    """Cost of every failure (boundary) and of checkpointing over the whole run."""
    step_s = _median_step_seconds(run)
    failures = []
    for b in find_boundaries(run):
        dead_end = None
        if b.dead is not None:
            times = [r.time for r in b.dead.steps if r.time is not None] + [
                e.time for e in b.dead.events if e.time
            ]
            dead_end = max(times) if times else None
        first_time = b.post.steps[0].time
        compiles = [e for e in b.post.events if isinstance(e, Compile)]
        crash = b.crash_step
        lost = max(0, crash - b.restored_step) if crash is not None else 0
        failures.append(
            FailureCost(
                boundary=b.index,
                session=b.post.session.id,
                crash_step=crash,
                restored_step=b.restored_step,
                steps_recomputed=lost,
                downtime_seconds=first_time - dead_end
                if first_time is not None and dead_end is not None
                else None,
                restore_seconds=b.restore.seconds if b.restore else None,
                compile_seconds=sum(c.seconds for c in compiles),
                compile_events=len(compiles),
                recompute_seconds=lost * step_s if step_s is not None else None,
                tier=b.restore.tier if b.restore else None,
            )
        )
    saves = [e for seg in segments(run) for e in seg.saves]
    blocking = sum(s.blocking_seconds or 0.0 for s in saves)
    total = sum(s.total_seconds or s.blocking_seconds or 0.0 for s in saves)
    compiles = [e for s in run.sessions for e in s.compiles]
    return RunCost(
        failures=failures,
        saves=len(saves),
        save_blocking_seconds=blocking,
        save_background_seconds=max(0.0, total - blocking),
        save_bytes=sum(s.bytes or 0 for s in saves),
        compile_events=len(compiles),
        compile_seconds=sum(c.seconds for c in compiles),
        median_step_seconds=step_s,
        tiers=tier_costs(failures),
    )
