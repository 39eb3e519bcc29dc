"""Finding checkpoints under a root: list manifests, order by step (never by mtime), check what they reference.

A checkpoint exists if and only if its ``step_<N>/manifest.json`` is present and valid; a step folder without
one is an uncommitted leftover (a save that crashed or is still in flight).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .errors import CkptError
from .manifest import MANIFEST_NAME, Manifest
from .reader import read_manifest
from .storage import Storage, open_storage

STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    name: str
    status: str  # "committed", "damaged" or "uncommitted"
    manifest: Manifest | None = None
    error: str | None = None


def missing_files(storage: Storage, manifest: Manifest) -> list[str]:
    """Files the manifest lists that are absent or of the wrong size (cheap: one stat per file)."""
    bad = []
    for path, f in manifest.files.items():
        size = storage.size(path)
        if size is None:
            bad.append(f"{path} (missing)")
        elif size != f.size:
            bad.append(f"{path} ({size} bytes, manifest says {f.size})")
    for e in manifest.v2.sealed_files() if manifest.v2 is not None else ():
        size = storage.size(e.path)
        if size is None:
            bad.append(f"{e.path} (missing)")
        elif size != e.size:
            bad.append(f"{e.path} ({size} bytes, manifest says {e.size})")
    return bad


def absent_files(storage: Storage, manifest: Manifest) -> list[str]:
    """Files the manifest lists that the folder does not hold (one listing; sizes not checked)."""
    present = set(storage.listdir())
    listed = [
        *manifest.files,
        *(e.path for e in (manifest.v2.sealed_files() if manifest.v2 is not None else ())),
    ]
    return [f"{path} (missing)" for path in listed if path.split("/", 1)[0] not in present]


def inspect_dir(root: Storage, name: str, check_files: bool = False) -> CheckpointInfo:
    step = parse_step(name)
    assert step is not None
    sub = root.child(name)
    if not sub.exists(MANIFEST_NAME):
        return CheckpointInfo(step, name, "uncommitted")
    try:
        m = read_manifest(sub, full=False)
    except CkptError as e:
        return CheckpointInfo(step, name, "damaged", error=str(e))
    if m.step != step:
        return CheckpointInfo(step, name, "damaged", m, f"{name}: manifest says step {m.step}")
    if check_files:
        bad = missing_files(sub, m)
        if bad:
            return CheckpointInfo(step, name, "damaged", m, f"{sub.display()}: " + ", ".join(bad[:4]))
    return CheckpointInfo(step, name, "committed", m)


def list_checkpoints(
    root: str | Storage,
    check_files: bool = False,
    storage_options: dict[str, Any] | None = None,
    threads: int = 16,
) -> list[CheckpointInfo]:
    """All step folders under ``root`` with their status, ordered by step."""
    storage = root if isinstance(root, Storage) else open_storage(root, storage_options)
    names = [n for n in storage.listdir() if parse_step(n) is not None]
    if storage.local or len(names) < 2:
        infos = [inspect_dir(storage, n, check_files) for n in names]
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            infos = list(pool.map(lambda n: inspect_dir(storage, n, check_files), names))
    return sorted(infos, key=lambda i: i.step)
