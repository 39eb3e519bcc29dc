"""Put a :class:`Verification` into words for people (lines, table rows, a verdict) and machines (JSON).

Styling (colours, table borders) is the CLI's job (``cli/render_resume.py``); this module decides what is
said, so the terminal tables, :func:`render_text` (assertion messages, logs) and the JSON agree.

Exit codes, as for every ckpt command: 0 the run is continuous at every boundary (warnings allowed),
1 a discontinuity was found, 2 bad input (raised as :class:`ckpt.errors.CkptError` before any report).
"""

from __future__ import annotations

from typing import NamedTuple

from ckpt.resume.checks import Status
from ckpt.resume.verify import BoundaryVerdict, Verification
from ckpt.words import count

EXIT_CONTINUOUS = 0
EXIT_DISCONTINUITY = 1
EXIT_BAD_INPUT = 2

NO_BOUNDARY = "No resume boundary found: nothing to verify."
CHECK_COLUMNS = ("check", "verdict", "cause", "details")


class CheckRow(NamedTuple):
    """One check at one boundary, as a table shows it."""

    check: str
    status: Status
    cause: str
    details: str


def boundary_json(v: BoundaryVerdict) -> dict[str, object]:
    b = v.boundary
    return {
        "index": b.index,
        "reason": b.reason,
        "session": b.post.session.id,
        "restored_step": b.restored_step,
        "restore_path": b.restore.path if b.restore else None,
        "restore_inferred": b.inferred,
        "first_step": b.post.steps[0].step,
        "crash_step": b.crash_step,
        "overlap_steps": len(b.overlap),
        "deterministic": v.deterministic,
        "status": v.status.value,
        "causes": [c.value for c in v.causes],
        "checks": [c.to_json() for c in v.checks],
    }


def to_json(result: Verification) -> dict[str, object]:
    """The whole verification as plain JSON types (floats unrounded)."""
    run = result.run
    return {
        "run": run.path,
        "source": run.source,
        "precision": run.precision,
        "sessions": len(run.sessions),
        "steps": run.num_steps,
        "status": result.status.value,
        "exit_code": result.exit_code,
        "causes": [c.value for c in result.causes],
        "notes": result.notes,
        "boundaries": [boundary_json(v) for v in result.verdicts],
    }


def run_line(result: Verification) -> tuple[str, str]:
    """(the run's path, what it is): ``("runs/x/ledger.jsonl", " (jsonl, 2 sessions, ...)")``."""
    run = result.run
    return run.path, (
        f" ({run.source}, {count(len(run.sessions), 'session')}, {run.num_steps} step records, values {run.precision})"
    )


def boundary_title(v: BoundaryVerdict) -> str:
    """Where the boundary is, what was restored from where, and how losses are compared."""
    b = v.boundary
    src = f" from {b.restore.path}" if b.restore and b.restore.path else ""
    how = "inferred" if b.inferred else "logged"
    crash = f", previous segment ended at step {b.crash_step}" if b.crash_step is not None else ""
    mode = "bitwise" if v.deterministic else "tolerance"
    return (
        f"Boundary {b.index}: restored step {b.restored_step}{src} ({how}, {b.reason}){crash}; "
        f"first step {b.post.steps[0].step}, {count(len(b.overlap), 'step overlaps', 'steps overlap')} the pre-crash log; loss mode: {mode}"
    )


def check_rows(v: BoundaryVerdict) -> list[CheckRow]:
    """One row per check; a failure explained by another check names what it follows from, and every judged
    verdict says against what and how sure: ``[trajectory, high]``."""
    rows = []
    for c in v.checks:
        cause = c.cause.value if c.cause else ""
        if c.explained_by:
            cause = f"(follows from: {', '.join(x.value for x in c.explained_by)})"
        judged = f" [{c.basis.value}, {c.confidence.value}]" if c.basis and c.confidence else ""
        rows.append(CheckRow(c.name, c.status, cause, c.summary + judged))
    return rows


def verdict_line(result: Verification) -> tuple[str, str]:
    """(word, the rest): ``("CONTINUOUS", " at 2 boundaries")`` or ``("DISCONTINUITY", ": LR off by one ...")``."""
    if result.status is Status.FAIL:
        return "DISCONTINUITY", ": " + "; ".join(dict.fromkeys(c.value for c in result.causes))
    warned = [c.value for c in result.causes]
    extra = f" (warnings: {'; '.join(dict.fromkeys(warned))})" if warned else ""
    return "CONTINUOUS", f" at {count(len(result.verdicts), 'boundary', 'boundaries')}{extra}"


def render_text(result: Verification) -> str:
    """The whole verification as plain text, one aligned table per boundary: for logs and assertion messages
    (the terminal gets the same words as styled tables from the CLI)."""
    path, what = run_line(result)
    lines = [path + what, *(f"note: {n}" for n in result.notes)]
    if not result.verdicts:
        lines.append(NO_BOUNDARY)
    for v in result.verdicts:
        lines.append(boundary_title(v))
        cells = [CHECK_COLUMNS] + [(r.check, r.status.value, r.cause, r.details) for r in check_rows(v)]
        widths = [max(len(row[i]) for row in cells) for i in range(3)]
        for row in cells:
            lines.append(
                "  " + "  ".join(x.ljust(w) for x, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
            )
    lines.append("".join(verdict_line(result)))
    return "\n".join(line.rstrip() for line in lines) + "\n"
