"""Render a :class:`Verification` for people (rich tables) and machines (JSON), and fix the exit codes.

Exit codes, as for every ckpt command: 0 the run is continuous at every boundary (warnings allowed),
1 a discontinuity was found, 2 bad input (raised as :class:`ckpt.errors.CkptError` before any report).
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckpt.resume.checks import Status
from ckpt.resume.verify import BoundaryVerdict, Verification

EXIT_CONTINUOUS = 0
EXIT_DISCONTINUITY = 1
EXIT_BAD_INPUT = 2

_STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim"}


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


def _title(v: BoundaryVerdict) -> str:
    b = v.boundary
    src = f" from {b.restore.path}" if b.restore and b.restore.path else ""
    how = "inferred" if b.inferred else "logged"
    crash = f", previous segment ended at step {b.crash_step}" if b.crash_step is not None else ""
    mode = "bitwise" if v.deterministic else "tolerance"
    return (
        f"Boundary {b.index}: restored step {b.restored_step}{src} ({how}, {b.reason}){crash}; "
        f"first step {b.post.steps[0].step}, {len(b.overlap)} steps overlap the pre-crash log; loss mode: {mode}"
    )


def render(result: Verification, console: Console | None = None) -> None:
    """Print one table per boundary (check, verdict, cause, numbers) and a one-line verdict."""
    console = console or Console()
    run = result.run
    console.print(
        f"[bold]{run.path}[/] ({run.source}, {len(run.sessions)} sessions, {run.num_steps} step records, "
        f"values {run.precision})"
    )
    for note in result.notes:
        console.print(f"[dim]note: {note}[/]")
    if not result.verdicts:
        console.print("No resume boundary found: nothing to verify.")
    for v in result.verdicts:
        table = Table(title=_title(v), title_justify="left", show_lines=False, expand=False)
        table.add_column("check")
        table.add_column("verdict")
        table.add_column("cause")
        table.add_column("details", overflow="fold")
        for c in v.checks:
            cause = c.cause.value if c.cause else ""
            if c.explained_by:
                cause = f"(follows from: {', '.join(x.value for x in c.explained_by)})"
            table.add_row(c.name, Text(c.status.value, style=_STYLE[c.status]), cause, c.summary)
        console.print(table)
    if result.status is Status.FAIL:
        causes = "; ".join(dict.fromkeys(c.value for c in result.causes))
        console.print(f"[bold red]DISCONTINUITY[/]: {causes}")
    else:
        warned = [c.value for c in result.causes]
        extra = f" (warnings: {'; '.join(dict.fromkeys(warned))})" if warned else ""
        console.print(f"[bold green]CONTINUOUS[/] at {len(result.verdicts)} boundaries{extra}")
