"""Read a CSV metrics log (header with ``step`` and any of loss, lr, grad_norm, ...) into a :class:`Run`.

Position columns: ``epoch`` (Lightning's ``CSVLogger`` writes it), ``samples``/``consumed_samples``,
``tokens``/``num_input_tokens_seen``; curriculum columns (``data/phase``, ``data/hard_fraction``) become the
step's ``phase``.

Values must be written with full precision (Python ``repr``); a CSV rounded by its writer can still be
checked between sessions but not bit for bit against a replayed schedule.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from pathlib import Path

from ckpt.resume.errors import RunInputError
from ckpt.resume.model import Run, Session, StepRecord
from ckpt.resume.sources.base import LogSource, is_phase_name, phase_text
from ckpt.resume.sources.lightning_dirs import csv_versions

_ALIASES = {
    "learning_rate": "lr",
    "global_step": "step",
    "session_id": "session",
    "train_loss": "loss",
    "train/loss": "loss",
    "consumed_samples": "samples",
    "num_input_tokens_seen": "tokens",
}
_FLOATS = ("loss", "lr", "grad_norm", "time", "epoch")
_INTS = ("samples", "tokens")


def read_csv(path: str | os.PathLike[str]) -> Run:
    """One session per distinct ``session`` column value (in order of appearance), else a single session
    that the boundary finder splits where the step goes back."""
    p = Path(path)
    try:
        fh = p.open(newline="")
    except OSError as exc:
        raise RunInputError(f"cannot read CSV {p}: {exc.strerror}") from None
    run = Run(path=str(p), source="csv", precision="float64")
    sessions: dict[str, Session] = {}
    with fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None:
            raise RunInputError(f"CSV {p} is empty")
        cols = {c: _ALIASES.get(c.strip().lower(), c.strip().lower()) for c in reader.fieldnames}
        if "step" not in cols.values():
            raise RunInputError(f"CSV {p} has no 'step' column (columns: {', '.join(reader.fieldnames)})")
        phases = [c for c in cols.values() if is_phase_name(c)]
        for row in reader:
            rec = {cols[k]: (v.strip() if isinstance(v, str) else v) for k, v in row.items() if k in cols}
            try:
                fields: dict[str, object] = {"step": int(rec["step"])}
                for k in _FLOATS:
                    if rec.get(k):
                        fields[k] = float(rec[k])
                for k in _INTS:
                    if rec.get(k):
                        fields[k] = int(rec[k])
                for k in ("data_digest", "rng_digest"):
                    if rec.get(k):
                        fields[k] = rec[k]
                fields["phase"] = phase_text({k: rec[k] for k in phases if rec.get(k)})
            except (TypeError, ValueError) as exc:
                raise RunInputError(f"{p}:{reader.line_num}: bad CSV row ({exc})") from None
            sid = rec.get("session") or ""
            session = sessions.get(sid)
            if session is None:
                session = sessions[sid] = Session(id=sid or p.name, origin=f"{p.name}:{reader.line_num}")
            session.steps.append(StepRecord(**fields))  # type: ignore[arg-type]
    run.sessions = list(sessions.values())
    run.sessions_logged = "session" in cols.values()
    if not run.sessions:
        raise RunInputError(f"CSV {p} has no rows")
    return run


def _probe(d: Path) -> bool:
    if csv_versions(d):
        return True
    csvs = list(d.glob("*.csv"))
    if len(csvs) > 1:
        raise RunInputError(f"several CSV files in {d}; pass the one to read")
    return len(csvs) == 1


def read_lightning_csv(path: Path, files: list[Path]) -> Run:
    """CSVLogger's ``version_<N>/metrics.csv`` files, each a session in version order."""
    run = Run(path=str(path), source="csv", precision="float64")
    for f in files:
        (session,) = read_csv(f).sessions  # a CSVLogger file has no session column: one session
        session.id, session.origin = f.parent.name, str(f.relative_to(path))
        run.sessions.append(session)
    run.sessions_logged = True
    return run


def _read(path: Path, tags: Mapping[str, str] | None) -> Run:
    versions = csv_versions(path) if path.is_dir() else []
    if versions:
        return read_lightning_csv(path, versions)
    if path.is_dir():
        csvs = sorted(path.glob("*.csv"))
        if len(csvs) != 1:
            raise RunInputError(f"expected one CSV file in {path}, found {len(csvs)}")
        path = csvs[0]
    return read_csv(path)


SOURCE = LogSource(
    name="csv",
    priority=3,
    file_patterns=("*.csv",),
    probe=_probe,
    looks_for="CSV",
    read=_read,
)
