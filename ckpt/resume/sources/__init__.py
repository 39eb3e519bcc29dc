"""Readers that turn a log in any supported format into the same :class:`ckpt.resume.model.Run`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from ckpt.resume.errors import RunInputError
from ckpt.resume.ledger import LEDGER_NAME
from ckpt.resume.model import Run
from ckpt.resume.sources.csv import read_csv
from ckpt.resume.sources.hf import read_hf
from ckpt.resume.sources.jsonl import read_jsonl
from ckpt.resume.sources.tensorboard import read_tensorboard

SourceKind = Literal["auto", "jsonl", "tensorboard", "csv", "hf"]
SOURCES: tuple[str, ...] = ("auto", "jsonl", "tensorboard", "csv", "hf")

__all__ = [
    "SOURCES",
    "SourceKind",
    "detect_source",
    "load_run",
    "read_csv",
    "read_hf",
    "read_jsonl",
    "read_tensorboard",
]


def detect_source(path: Path) -> str:
    """Which reader fits ``path``: the ledger wins, then a Trainer state, then TensorBoard, then one CSV."""
    if path.is_file():
        name = path.name
        if name.endswith(".jsonl"):
            return "jsonl"
        if name.endswith(".csv"):
            return "csv"
        if name == "trainer_state.json":
            return "hf"
        if "tfevents" in name:
            return "tensorboard"
        raise RunInputError(f"cannot tell the format of {path}; pass --source")
    if (path / LEDGER_NAME).is_file():
        return "jsonl"
    if (path / "trainer_state.json").is_file() or any(path.glob("checkpoint-*/trainer_state.json")):
        return "hf"
    if any(path.rglob("*tfevents*")):
        return "tensorboard"
    csvs = sorted(path.glob("*.csv"))
    if len(csvs) == 1:
        return "csv"
    if len(csvs) > 1:
        raise RunInputError(f"several CSV files in {path}; pass the one to read")
    raise RunInputError(f"no {LEDGER_NAME}, trainer_state.json, TensorBoard events or CSV in {path}")


def load_run(
    path: str | os.PathLike[str], source: SourceKind | str = "auto", *, tags: Mapping[str, str] | None = None
) -> Run:
    """Read the run at ``path`` (a run directory or a single log file) with the given or detected reader."""
    p = Path(path)
    if not p.exists():
        raise RunInputError(f"run directory {p} does not exist")
    kind = detect_source(p) if source == "auto" else source
    if kind == "jsonl":
        return read_jsonl(p / LEDGER_NAME if p.is_dir() else p)
    if kind == "tensorboard":
        return read_tensorboard(p, tags)
    if kind == "csv":
        if p.is_dir():
            csvs = sorted(p.glob("*.csv"))
            if len(csvs) != 1:
                raise RunInputError(f"expected one CSV file in {p}, found {len(csvs)}")
            p = csvs[0]
        return read_csv(p)
    if kind == "hf":
        return read_hf(p)
    raise RunInputError(f"unknown source {source!r}; expected one of {', '.join(SOURCES)}")
