"""Read ``<run>/ledger.jsonl`` (written by :class:`ckpt.resume.ledger.LedgerWriter`) into a :class:`Run`."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from ckpt.resume.errors import RunInputError
from ckpt.resume.ledger import LEDGER_NAME
from ckpt.resume.model import Compile, Exit, Restore, Run, Save, Session, SessionStart, StepRecord
from ckpt.resume.sources.base import LogSource, phase_text


def _opt_float(rec: dict, key: str) -> float | None:
    v = rec.get(key)
    return None if v is None else float(v)


def _opt_int(rec: dict, key: str) -> int | None:
    v = rec.get(key)
    return None if v is None else int(v)


def _floats(value: object) -> tuple[float, ...]:
    if value is None:
        return ()
    if not (isinstance(value, list) and all(isinstance(v, (int, float)) for v in value)):
        raise TypeError("scheduled_lr must be a list of numbers")
    return tuple(float(v) for v in value)


def _strings(value: object) -> dict[str, str] | None:
    """A save-time fact (``rng_digests``, ``weights_sample``): an object of strings, or None when not logged."""
    if value is None:
        return None
    if not (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
        raise TypeError("rng_digests and weights_sample must be objects of strings")
    return {str(k): v for k, v in value.items()}


def read_jsonl(path: str | os.PathLike[str]) -> Run:
    """Parse a ledger; sessions are grouped by their ``session`` id in order of first appearance.

    A line that is not JSON is an error naming its line number, except a torn line: the last line when the
    file does not end in a newline, or a line directly followed by a ``session_start`` (a process killed
    mid-write whose successor ended the line).  Those are skipped and noted on the run.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise RunInputError(f"no ledger at {p}") from None
    except OSError as exc:
        raise RunInputError(f"cannot read ledger {p}: {exc.strerror}") from None
    lines = data.split(b"\n")
    run = Run(path=str(p), source="jsonl", precision="float64")
    sessions: dict[str, Session] = {}
    loads = json.loads
    pending_torn: int | None = None
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            rec = loads(raw)
            if not isinstance(rec, dict):
                raise ValueError("not an object")
        except ValueError:
            if pending_torn is not None:
                raise RunInputError(f"{p}:{pending_torn}: malformed ledger line (not JSON)") from None
            pending_torn = lineno
            continue
        kind = rec.get("kind")
        if pending_torn is not None:
            if kind != "session_start":
                raise RunInputError(f"{p}:{pending_torn}: malformed ledger line (not JSON)")
            run.notes.append(f"line {pending_torn}: torn line skipped (process killed mid-write)")
            pending_torn = None
        sid = str(rec.get("session", ""))
        session = sessions.get(sid)
        if session is None:
            session = sessions[sid] = Session(id=sid, origin=f"{p.name}:{lineno}")
        try:
            _add(session, kind, rec)
        except (KeyError, TypeError, ValueError) as exc:
            raise RunInputError(f"{p}:{lineno}: bad {kind!r} record ({type(exc).__name__}: {exc})") from None
    if pending_torn is not None:
        if data.endswith(b"\n"):
            raise RunInputError(f"{p}:{pending_torn}: malformed ledger line (not JSON)")
        run.notes.append(f"line {pending_torn}: torn last line skipped (process killed mid-write)")
    run.sessions = list(sessions.values())
    if not any(s.steps for s in run.sessions):
        raise RunInputError(f"ledger {p} has no step records")
    return run


def _phase(value: object) -> str | None:
    """A step's ``phase``: an object of curriculum fields, or already one string."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise TypeError("phase must be an object or a string")
    return phase_text(value)


def _add(session: Session, kind: object, rec: dict) -> None:
    t = _opt_float(rec, "time")
    if kind == "step":
        step = rec["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an integer, got {step!r}")
        session.steps.append(
            StepRecord(
                step=step,
                loss=_opt_float(rec, "loss"),
                lr=_opt_float(rec, "lr"),
                grad_norm=_opt_float(rec, "grad_norm"),
                samples=_opt_int(rec, "samples"),
                tokens=_opt_int(rec, "tokens"),
                data_digest=rec.get("data_digest"),
                rng_digest=rec.get("rng_digest"),
                time=t,
                epoch=_opt_float(rec, "epoch"),
                phase=_phase(rec.get("phase")),
            )
        )
    elif kind == "session_start":
        env = rec.get("env") or {}
        if not isinstance(env, dict):
            raise TypeError("env must be an object")
        session.add_event(SessionStart(time=t, env=env))
    elif kind == "restore":
        digest, views = rec.get("model_digest"), rec.get("model_views")
        for key, value in (("model_digest", digest), ("model_views", views)):
            if value is not None and not (
                isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
            ):
                raise TypeError(f"{key} must be an object of strings")
        names = {key: rec.get(key) or [] for key in ("unloaded", "unfilled")}
        for key, value in names.items():
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise TypeError(f"{key} must be a list of tensor names")
        session.add_event(
            Restore(
                time=t,
                step=int(rec["step"]),
                path=rec.get("path"),
                seconds=_opt_float(rec, "seconds"),
                model_digest=digest,
                optimizer_step=_opt_int(rec, "optimizer_step"),
                model_views=views,
                unloaded=tuple(names["unloaded"]),
                unfilled=tuple(names["unfilled"]),
                tier=rec["tier"] if isinstance(rec.get("tier"), str) else None,
                optimizer=rec["optimizer"] if isinstance(rec.get("optimizer"), dict) else None,
                scheduled_lr=_floats(rec.get("scheduled_lr")),
                rng_digests=_strings(rec.get("rng_digests")),
            )
        )
    elif kind == "save":
        session.add_event(
            Save(
                time=t,
                step=int(rec["step"]),
                path=rec.get("path"),
                blocking_seconds=_opt_float(rec, "blocking_seconds"),
                total_seconds=_opt_float(rec, "total_seconds"),
                bytes=_opt_int(rec, "bytes"),
                rng_digests=_strings(rec.get("rng_digests")),
                weights_sample=_strings(rec.get("weights_sample")),
            )
        )
    elif kind == "compile":
        session.add_event(Compile(time=t, seconds=float(rec["seconds"]), what=rec.get("what")))
    elif kind == "exit":
        session.add_event(Exit(time=t, clean=bool(rec.get("clean", True))))
    # Unknown kinds are ignored: newer writers may add events this reader does not need.


def _read(path: Path, tags: Mapping[str, str] | None) -> Run:
    return read_jsonl(path / LEDGER_NAME if path.is_dir() else path)


SOURCE = LogSource(
    name="jsonl",
    priority=0,
    file_patterns=("*.jsonl",),
    probe=lambda d: (d / LEDGER_NAME).is_file(),
    looks_for=LEDGER_NAME,
    read=_read,
)
"""The ledger: ckpt's own log (with save, restore and environment events) wins over any other log beside it."""
