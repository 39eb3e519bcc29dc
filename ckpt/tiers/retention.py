"""What a node keeps in its local tier: the ``keep_local`` newest committed steps, none older than the newest
persistent step (that one is at least as new and durable), and no step newer than the one just saved (those belong
to a timeline a restore abandoned: it would have restored them had they been complete).

Each node's leader sweeps its own folder after every local commit.  A step is deleted manifest first, so a crash
in the middle leaves a folder without a manifest, which nothing takes for a checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from ..format.manifest import MANIFEST_NAME
from ..restoring.discovery import parse_step, step_dir
from .runid import step_run_id

#: folders (hidden: ``ckpt ls`` and discovery skip them) holding local saves and restore fetches in flight
PENDING = ".pending"
FETCH = ".fetch"


def local_steps(root: Path) -> list[int]:
    """Steps with a committed-looking folder (``step_<N>/manifest.json``) under ``root``, ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = [s for s in map(parse_step, names) if s is not None]
    return sorted(s for s in steps if (root / step_dir(s) / MANIFEST_NAME).is_file())


def drop(folder: Path) -> None:
    """Delete one step folder, manifest first."""
    with contextlib.suppress(FileNotFoundError):
        (folder / MANIFEST_NAME).unlink()
    shutil.rmtree(folder, ignore_errors=True)


def sweep(
    root: Path,
    newest: int,
    keep_local: int | None,
    newest_persistent: int | None,
    run_id: str | None,
    copying: int | None = None,
) -> list[int]:
    """Apply the policy (module docstring) after ``newest`` was committed to run ``run_id``'s folder ``root``;
    returns the steps deleted.  A step whose manifest records another run id, or none, is never deleted, nor step
    ``copying`` (being copied to the persistent tier)."""
    steps = [s for s in local_steps(root) if step_run_id(root / step_dir(s)) == run_id]
    present = set(local_steps(root))
    keep = set(steps if keep_local is None else steps[-keep_local:]) | {newest} | {copying}
    deleted = []
    for s in steps:
        stale = s > newest or (newest_persistent is not None and s < newest_persistent and s != newest)
        if s not in keep or stale:
            drop(root / step_dir(s))
            deleted.append(s)
    for name in os.listdir(root):  # leftovers of a delete that crashed half-way
        s = parse_step(name)
        if s is not None and s not in present:
            shutil.rmtree(root / name, ignore_errors=True)
    for hidden in (PENDING, FETCH):
        shutil.rmtree(root / hidden, ignore_errors=True)
    return deleted
