"""Readers that turn a log in any supported format into the same :class:`ckpt.resume.model.Run`.

Every format is one module that ends with a ``SOURCE = LogSource(...)`` declaration (name, file-name
patterns, directory probe with its detection priority, reader); :data:`TABLE` lists them, and
:func:`load_run`, :func:`detect_source`, :data:`SOURCES` and the CLI's ``--source`` choices all come from
it.  Adding a format is one module and one line here (docs/run-dir.md, "Adding a log source").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from fnmatch import fnmatchcase
from pathlib import Path

from ckpt.resume.errors import RunInputError
from ckpt.resume.model import Run
from ckpt.resume.sources import csv, hf, jsonl, tensorboard
from ckpt.resume.sources.base import LogSource
from ckpt.resume.sources.csv import read_csv
from ckpt.resume.sources.hf import read_hf
from ckpt.resume.sources.jsonl import read_jsonl
from ckpt.resume.sources.tensorboard import read_tensorboard

TABLE: tuple[LogSource, ...] = (jsonl.SOURCE, tensorboard.SOURCE, csv.SOURCE, hf.SOURCE)
"""Every log format, in the order ``--source`` lists them; detection follows each one's ``priority``."""

SOURCES: tuple[str, ...] = ("auto", *(s.name for s in TABLE))
"""The values of ``--source``: ``auto`` (detect) or a format's name."""

SourceKind = str
"""One of :data:`SOURCES`."""

__all__ = [
    "SOURCES",
    "TABLE",
    "LogSource",
    "SourceKind",
    "detect_source",
    "load_run",
    "read_csv",
    "read_hf",
    "read_jsonl",
    "read_tensorboard",
]


def _by_priority() -> list[LogSource]:
    return sorted(TABLE, key=lambda s: s.priority)


def _names(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def detect_source(path: Path) -> str:
    """Which reader fits ``path``: a file by its name, a directory by each format's probe in priority order
    (the ledger wins, then a Trainer state, then TensorBoard, then one CSV)."""
    if path.is_file():
        for source in _by_priority():
            if any(fnmatchcase(path.name, pattern) for pattern in source.file_patterns):
                return source.name
        raise RunInputError(f"cannot tell the format of {path}; pass --source")
    for source in _by_priority():
        if source.probe(path):
            return source.name
    raise RunInputError(f"no {_names([s.looks_for for s in _by_priority()])} in {path}")


def load_run(
    path: str | os.PathLike[str], source: SourceKind = "auto", *, tags: Mapping[str, str] | None = None
) -> Run:
    """Read the run at ``path`` (a run directory or a single log file) with the given or detected reader."""
    p = Path(path)
    if not p.exists():
        raise RunInputError(f"run directory {p} does not exist")
    name = detect_source(p) if source == "auto" else source
    for entry in TABLE:
        if entry.name == name:
            return entry.read(p, tags)
    raise RunInputError(f"unknown source {source!r}; expected one of {', '.join(SOURCES)}")
