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
