"""What a log source declares so that ``load_run``, auto-detection and ``--source`` find it.

Each reader module ends with one ``SOURCE = LogSource(...)``; :data:`ckpt.resume.sources.TABLE` lists them.
Adding a format is a module with its reader and that declaration, plus its line in the table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ckpt.resume.model import Run

Reader = Callable[[Path, Mapping[str, str] | None], Run]
"""``read(path, tags)``: the run at ``path`` (a log file or a run directory, as the user gave it); ``tags``
maps a field to the name the log uses for it (only TensorBoard needs it today; others ignore it)."""


@dataclass(frozen=True, slots=True)
class LogSource:
    """One log format: its name, how a path is recognised as it, and its reader.

    ``priority`` orders auto-detection (lowest first): a run directory can hold several logs (a ledger beside
    TensorBoard events), and the most complete one must win.  ``probe(directory)`` says whether the
    directory holds this format; it may raise :class:`~ckpt.resume.errors.RunInputError` when it does but
    ambiguously (two CSV files).  ``looks_for`` names what the probe looks for, for the error when no
    source matches.
    """

    name: str
    priority: int
    file_patterns: tuple[str, ...]
    """``fnmatch`` patterns (case-sensitive) of the name of a single log file of this format."""
    probe: Callable[[Path], bool]
    looks_for: str
    read: Reader


_PHASE_WORDS = ("phase", "curriculum", "stage")
_PHASE_SCOPES = ("data", "curriculum")


def is_phase_name(name: str) -> bool:
    """Whether a logged metric names the curriculum / data-mix state: a last component with ``phase``,
    ``curriculum`` or ``stage`` in it (``data/phase``, ``curriculum_stage``), or a ``*_fraction`` / ``*mix``
    under ``data/`` or ``curriculum/`` (``data/hard_fraction``).  Narrow on purpose: a metric that changes
    every step (``data/load_time``) is not a schedule."""
    parts = [p for p in name.lower().replace(".", "/").split("/") if p]
    if not parts:
        return False
    last = parts[-1]
    if any(w in last for w in _PHASE_WORDS):
        return True
    return (
        len(parts) > 1 and parts[0] in _PHASE_SCOPES and (last.endswith("fraction") or last.endswith("mix"))
    )


def phase_text(values: Mapping[str, object]) -> str | None:
    """The phase fields of one step as one comparable string (sorted ``name=value``), None when empty."""
    if not values:
        return None
    return ", ".join(f"{k}={_plain(v)}" for k, v in sorted(values.items()))


def _plain(v: object) -> str:
    return (
        repr(float(v))
        if isinstance(v, float) and not float(v).is_integer()
        else (str(int(v)) if isinstance(v, float) else str(v))
    )
