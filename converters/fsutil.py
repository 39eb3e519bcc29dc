"""Atomic publication of a foreign-format folder: build it hidden next to the destination, rename at the end.

A crash leaves at most a hidden ``.<name>.tmp-<id>`` folder, never a destination that looks valid.  Local paths
only (HF, DCP and NxD folders are read by tools that expect local directories).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from ckpt.errors import CheckpointExistsError, CkptError


def check_dst_free(dst: str | Path) -> None:
    """Refuse an existing, non-empty destination (nothing is ever overwritten)."""
    p = Path(dst)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise CheckpointExistsError(f"{p}: already exists; choose a new DST")


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_temp_dir(dst: str | Path) -> Path:
    """Create and return the hidden temp folder ``.<name>.tmp-<id>`` next to ``dst`` (refusing a used ``dst``).

    Split from :func:`atomic_dir` so that a coordinator can create the folder, let worker processes (or torchrun
    ranks on a shared filesystem) fill it, and publish it itself: the folder is on the destination's filesystem,
    so :func:`publish_dir` is one rename.
    """
    final = Path(dst)
    if "://" in str(dst):
        raise CkptError(f"{dst}: this format is written to local paths only")
    check_dst_free(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def publish_dir(tmp: Path, dst: str | Path) -> None:
    """fsync the files of ``tmp`` (and the folder), then rename it to ``dst``: the folder appears complete or not at all."""
    final = Path(dst)
    for f in tmp.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(tmp)
    if final.exists():
        final.rmdir()  # empty (checked when the temp folder was made); a non-empty one makes this fail
    os.rename(tmp, final)
    fsync_dir(final.parent)


def remove_dir(tmp: Path) -> None:
    """Remove a temp folder and everything in it (idempotent; the destination is never touched)."""
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(dst: str | Path) -> Iterator[Path]:
    """Yield a temp folder next to ``dst``; on success fsync it and rename it to ``dst``, else remove it."""
    tmp = make_temp_dir(dst)
    try:
        yield tmp
        publish_dir(tmp, dst)
    except BaseException:
        remove_dir(tmp)
        raise
