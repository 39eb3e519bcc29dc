"""Which run a local step belongs to (docs/guide.md, "Run identity").

A run is its persistent root.  The first save of a :class:`~ckpt.manager.CheckpointManager` with tiers records a
fresh run id in ``<root>/run.json`` (create-only); a manager constructed later on the same root (a restart) reads it
back, so a run restarted on the same root is the same run.  The run's local steps live in
``<local_dir>/run-<id>/step_<N>/`` and their manifests carry ``run_id``; the run folder's own ``run.json`` names the
root, so a restart that cannot read the root (the object store down) still knows its run when exactly one run
folder of its node names that root.

A restore takes only this run's steps.  Everything else under ``local_dir`` (another run's folder, a step saved
there by an older ckpt or by hand, a step whose manifest names another run or none) is named in one warning, never
restored, and never deleted by this run: a reused ``local_dir`` (``/local/nvme/ckpt`` on a cluster) may hold a run
that still needs it.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

from ..errors import CheckpointExistsError, CkptError
from ..format.manifest import MANIFEST_NAME
from ..restoring.discovery import parse_step
from ..storage import Storage, open_storage

RUN_FILE = "run.json"
KIND = "ckpt-run"
ID_RE = re.compile(r"^[0-9a-f]{16}$")
PREFIX = "run-"


def new_id() -> str:
    """A fresh run id: 16 hex digits."""
    return uuid.uuid4().hex[:16]


def folder(local_dir: Path, run_id: str) -> Path:
    """The run's folder of the node-local tier."""
    return local_dir / f"{PREFIX}{run_id}"


def record(run_id: str, root: str) -> bytes:
    """A ``run.json``: the run's id and the persistent root it belongs to."""
    doc = {"format": KIND, "version": 1, "run_id": run_id, "root": root}
    return (json.dumps(doc, indent=1) + "\n").encode()


def parse(raw: bytes, where: str) -> dict[str, str]:
    """A ``run.json``'s members, checked; CkptError naming ``where`` when it is not one."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CkptError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != KIND:
        raise CkptError(f"{where}: not a ckpt run record (expected format {KIND!r})")
    rid = doc.get("run_id")
    if not isinstance(rid, str) or not ID_RE.match(rid):
        raise CkptError(f"{where}: run_id {rid!r} is not 16 hex digits")
    return {"run_id": rid, "root": str(doc.get("root", ""))}


def read_root(storage: Storage) -> str | None:
    """The run id recorded in the persistent root, None when none is.  A garbled record raises CkptError (never
    replaced: it may be a run's); an unreachable store raises its StorageError / OSError."""
    if not storage.exists(RUN_FILE):
        return None
    return parse(storage.read_bytes(RUN_FILE), storage.display(RUN_FILE))["run_id"]


def record_in_root(storage: Storage, run_id: str, root: str) -> str:
    """Record ``run_id`` in the root, create-only; the id the root holds afterwards (another manager's, when one
    recorded first)."""
    try:
        storage.put_bytes(RUN_FILE, record(run_id, root), exclusive=True)
        return run_id
    except CheckpointExistsError:
        held = read_root(storage)
        assert held is not None
        return held


def ensure_local(local_dir: Path, run_id: str, root: str) -> None:
    """Create the run's folder with its ``run.json`` (a node leader, before it writes into it)."""
    target = folder(local_dir, run_id)
    if (target / RUN_FILE).is_file():
        return
    with_parents = open_storage(str(target))
    try:
        with_parents.put_bytes(RUN_FILE, record(run_id, root), exclusive=True)
    except CheckpointExistsError:
        pass


def runs_naming(local_dir: Path, root: str) -> list[str]:
    """The ids of the run folders under ``local_dir`` whose ``run.json`` names ``root``."""
    out = []
    for name in _listdir(local_dir):
        if not name.startswith(PREFIX):
            continue
        try:
            doc = parse((local_dir / name / RUN_FILE).read_bytes(), str(local_dir / name / RUN_FILE))
        except (CkptError, OSError):
            continue
        if doc["root"] == root and name == f"{PREFIX}{doc['run_id']}":
            out.append(doc["run_id"])
    return sorted(out)


def step_run_id(step_folder: Path) -> str | None:
    """The ``run_id`` a step folder's manifest records; None when it records none, a garbled one, or cannot be
    read (a light read: the JSON member only, not the whole manifest's validation)."""
    try:
        doc = json.loads((step_folder / MANIFEST_NAME).read_bytes())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    rid = doc.get("run_id") if isinstance(doc, dict) else None
    return rid if isinstance(rid, str) and ID_RE.match(rid) else None


def foreign_steps(local_dir: Path, run_id: str | None) -> list[str]:
    """Every step under ``local_dir`` that is not ``run_id``'s, each as ``<path> (<whose>)``: steps directly in
    ``local_dir`` (no run folder), other runs' folders, and steps in this run's folder whose manifest records
    another run id or none."""
    out = []
    for name in _listdir(local_dir):
        path = local_dir / name
        if parse_step(name) is not None and (path / MANIFEST_NAME).is_file():
            out.append(f"{path} ({_whose(step_run_id(path))})")
        elif name.startswith(PREFIX) and path.is_dir():
            mine = run_id is not None and name == f"{PREFIX}{run_id}"
            for sub in _listdir(path):
                step = path / sub
                if parse_step(sub) is None or not (step / MANIFEST_NAME).is_file():
                    continue
                rid = step_run_id(step)
                if not mine or rid != run_id:
                    out.append(f"{step} ({_whose(rid)})")
    return out


def _whose(rid: str | None) -> str:
    return f"run {rid}" if rid is not None else "no run id, or a garbled one"


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
