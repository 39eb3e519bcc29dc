"""Find resume boundaries: the points where training continued from restored state.

A run is cut into *segments* of steps that were trained in one go: a new segment starts with each session,
at a restore event in the middle of a session (an in-process retry), and wherever the step goes back or
repeats (logs without session information).  Every segment after the first is a boundary, as is a first
segment that logged a restore.  The restore point ``N`` is the restore event's step, or else the first step
minus one (``inferred``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckpt.resume.model import Event, Restore, Run, Save, Session, SessionStart, StepRecord


@dataclass(slots=True)
class Segment:
    """Steps trained in one go, with the events logged among them (a restore, if any, comes first)."""

    index: int
    session: Session
    steps: list[StepRecord]
    events: list[Event] = field(default_factory=list)

    @property
    def restore(self) -> Restore | None:
        return next((e for e in self.events if isinstance(e, Restore)), None)

    @property
    def env(self) -> dict[str, object]:
        return self.session.env

    @property
    def saves(self) -> list[Save]:
        return [e for e in self.events if isinstance(e, Save)]


@dataclass(slots=True)
class Boundary:
    """A resume: segment ``post`` continued from step ``restored_step`` after ``dead`` (the segment that ended).

    ``pre`` is the effective history before ``post``: for every step, the record of the latest segment that
    logged it, so it holds both the steps ``post`` continues from (<= N) and the pre-crash steps it must
    reproduce (> N, the free A/B).  ``newest_save`` is the newest checkpoint committed before ``post``.
    """

    index: int
    post: Segment
    dead: Segment | None
    pre: dict[int, StepRecord]
    restored_step: int
    restore: Restore | None
    reason: str
    newest_save: Save | None
    saved_steps: frozenset[int]
    #: every save event logged before ``post``, in log order (the save-time facts of the restored step's)
    saves: tuple[Save, ...] = ()

    def save_of(self, step: int) -> Save | None:
        """The last save of ``step`` logged before ``post``: the checkpoint a restore of ``step`` read."""
        return next((s for s in reversed(self.saves) if s.step == step), None)

    @property
    def inferred(self) -> bool:
        return self.restore is None or self.restore.inferred

    @property
    def overlap(self) -> list[int]:
        """Steps logged both before the crash and after the resume, in post order."""
        pre = self.pre
        return [r.step for r in self.post.steps if r.step in pre]

    @property
    def crash_step(self) -> int | None:
        return self.dead.steps[-1].step if self.dead and self.dead.steps else None


def segments(run: Run) -> list[Segment]:
    """Cut every session of ``run`` into segments (see module docstring)."""
    out: list[Segment] = []
    for session in run.sessions:
        cuts = {0}
        for ev, pos in zip(session.events, session.event_positions, strict=True):
            if isinstance(ev, Restore) and pos > 0:
                cuts.add(pos)
        steps = session.steps
        for i in range(1, len(steps)):
            if steps[i].step <= steps[i - 1].step:
                cuts.add(i)
        bounds = sorted(cuts) + [len(steps)]
        segs = [
            Segment(len(out) + j, session, steps[a:b])
            for j, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
        ]
        if not segs:
            segs = [Segment(len(out), session, [])]
        starts = bounds[:-1]
        for ev, pos in zip(session.events, session.event_positions, strict=True):
            # An event belongs to the segment whose steps follow it; a save/compile/exit logged right at a
            # cut belongs to the segment it ended, a restore/session_start to the one it began.
            j = len(segs) - 1 if pos >= len(steps) else max(k for k, a in enumerate(starts) if a <= pos)
            if not isinstance(ev, (Restore, SessionStart)) and j > 0 and pos == starts[j]:
                j -= 1
            segs[j].events.append(ev)
        out.extend(segs)
    return out


def find_boundaries(run: Run) -> list[Boundary]:
    """Every resume boundary of ``run``, in order."""
    segs = [s for s in segments(run) if s.steps or s.restore]
    boundaries: list[Boundary] = []
    history: dict[int, StepRecord] = {}
    saves: list[Save] = []
    prev: Segment | None = None
    for seg in segs:
        restore = seg.restore
        if seg.steps and (prev is not None or restore is not None):
            if restore is not None:
                n, reason = restore.step, "restore event" if not restore.inferred else "inferred restore"
            else:
                n = seg.steps[0].step - 1
                reason = (
                    "new session" if prev is None or prev.session is not seg.session else "step went back"
                )
            newest = max(saves, key=lambda s: s.step) if saves else None
            boundaries.append(
                Boundary(
                    index=len(boundaries) + 1,
                    post=seg,
                    dead=prev,
                    pre=dict(history),
                    restored_step=n,
                    restore=restore,
                    reason=reason,
                    newest_save=newest,
                    saved_steps=frozenset(s.step for s in saves),
                    saves=tuple(saves),
                )
            )
        for r in seg.steps:
            history[r.step] = r
        saves.extend(seg.saves)
        if seg.steps:
            prev = seg
    return boundaries


def session_start(segment: Segment) -> SessionStart | None:
    """The session_start of the session a segment belongs to (its environment)."""
    return segment.session.start


def suspected_boundaries(run: Run, known: list[Boundary]) -> list[Boundary]:
    """Candidate resume points of a log that marks no sessions: every checkpoint N (a save event) inside a
    segment, with steps logged on both sides, that is not already a boundary.  A resume there is only
    *suspected*; the verifier reports one only when the values show a discontinuity at it."""
    taken = {(b.post.steps[0].step, b.restored_step) for b in known}
    out: list[Boundary] = []
    history: dict[int, StepRecord] = {}
    saves: list[Save] = []
    for seg in segments(run):
        steps = {r.step for r in seg.steps}
        for save in sorted(seg.saves, key=lambda e: e.step):
            n = save.step
            after = [r for r in seg.steps if r.step > n]
            before = [r for r in seg.steps if r.step <= n]
            if n not in steps or not after or (after[0].step, n) in taken:
                continue
            pre = dict(history)
            pre.update({r.step: r for r in before})
            earlier = [e for e in saves + seg.saves if e.step <= n]
            out.append(
                Boundary(
                    index=0,
                    post=Segment(seg.index, seg.session, after),
                    dead=Segment(seg.index, seg.session, before),
                    pre=pre,
                    restored_step=n,
                    restore=Restore(time=None, step=n, path=save.path, inferred=True),
                    reason=f"suspected: checkpoint {n} (the log marks no process starts)",
                    newest_save=max(earlier, key=lambda e: e.step),
                    saved_steps=frozenset(e.step for e in earlier),
                    saves=tuple(earlier),
                )
            )
        for r in seg.steps:
            history[r.step] = r
        saves.extend(seg.saves)
    return out
