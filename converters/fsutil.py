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


@contextlib.contextmanager
def atomic_dir(dst: str | Path) -> Iterator[Path]:
    """Yield a temp folder next to ``dst``; on success fsync it and rename it to ``dst``, else remove it."""
    final = Path(dst)
    if "://" in str(dst):
        raise CkptError(f"{dst}: this format is written to local paths only")
    check_dst_free(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        if final.exists():
            final.rmdir()  # empty (checked above)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
