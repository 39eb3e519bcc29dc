"""Finding checkpoints under a root: list manifests, order by step (never by mtime), check what they reference.

A checkpoint exists if and only if its ``step_<N>/manifest.json`` is present and valid; a step folder without
one is an uncommitted leftover (a save that crashed or is still in flight).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import CkptError
from ..format.integrity import file_problems
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.reader import read_manifest
from ..storage import Storage, open_storage
from .other_tools import LIGHTNING, deepspeed_folder, file_tool, folder_tool

STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class CheckpointInfo:
    step: int | None  # None: unknown (an unreadable manifest in a folder not named step_<N>)
    name: str
    status: str  # "committed", "damaged" or "uncommitted"
    manifest: Manifest | None = None
    error: str | None = None


def missing_files(storage: Storage, manifest: Manifest) -> list[str]:
    """Files the manifest lists that are absent or of the wrong size (cheap: one stat per file, no reads)."""
    return [f"{path} ({why.split(' (', 1)[0]})" for path, why in file_problems(storage, manifest).items()]


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


#: how deep ``ckpt ls`` looks for checkpoints below its root (``run/checkpoints/step_N``, ``out/exp1/conv/gpu-500``)
FIND_DEPTH = 3

_TRAINER_STATE = "trainer_state.json"


@dataclass(frozen=True)
class Found:
    """A checkpoint folder found under a root: ``rel`` its path below the root (``""``: the root itself), ``kind``
    ``"ckpt"`` (ours), ``"nxd"`` (an NxD tag), ``"hf-trainer"`` (a Trainer ``checkpoint-N``), ``"hf-trainer-lora"``
    (a Trainer ``checkpoint-N`` of a PEFT LoRA run), ``"hf"`` (a Hugging Face model folder), ``"dcp"`` or
    ``"accelerate"`` (a ``save_state`` folder); or a checkpoint of a tool not supported yet
    (:data:`.other_tools.KINDS`: a Lightning ``.ckpt`` file)."""

    rel: str
    kind: str


def folder_kind(names: set[str], is_dir: Any) -> str | None:
    """What one folder is, from its listing alone (no torch): see :class:`Found`; None for none of them.

    ``is_dir(name)`` says whether an entry is a folder (NxD's ``model/`` and ``optim/``)."""
    if MANIFEST_NAME in names:
        return "ckpt"
    if ".metadata" in names and any(n.endswith(".distcp") for n in names):
        return "dcp"
    if ("model" in names and is_dir("model")) or ("optim" in names and is_dir("optim")):
        return "nxd"
    if ("done" in names or "checkpoint" in names) and any(
        n.startswith(("dp_rank_", "tp_rank_")) for n in names
    ):
        return "nxd"
    if {"adapter_config.json", "adapter_model.safetensors", _TRAINER_STATE} <= names:
        return "hf-trainer-lora"  # a Trainer's checkpoint-N of a PEFT LoRA run
    if _TRAINER_STATE not in names and folder_tool(names):  # save_state's files, whatever else is there
        return folder_tool(names)
    weights = any(n.endswith(".safetensors") or n.endswith(".index.json") for n in names)
    if "config.json" in names and weights:
        return "hf-trainer" if _TRAINER_STATE in names else "hf"
    if _TRAINER_STATE in names and weights:
        return "hf-trainer"
    return folder_tool(names)  # an accelerate save_state folder (converters/accelerate.py reads it)


def find_checkpoints(root: str | Storage, max_depth: int = FIND_DEPTH) -> list[Found]:
    """Every checkpoint folder ``ckpt`` reads under ``root``, up to ``max_depth`` levels down, by its listing only.

    A found checkpoint is not looked into (a tag's ``model/`` is part of the tag); hidden folders (our writers'
    temporary ones) are skipped.  On an object store only the root's direct children are looked at (one listing
    each), and only for our format: other formats are read from local folders only.
    """
    storage = root if isinstance(root, Storage) else open_storage(root)
    if not storage.local:  # one request per child: in threads, as list_checkpoints reads step folders
        names = [n for n in storage.listdir() if not n.startswith(".")]
        with ThreadPoolExecutor(max_workers=16) as pool:
            held = list(pool.map(lambda n: storage.exists(f"{n}/{MANIFEST_NAME}"), names))
        return [Found(n, "ckpt") for n, h in zip(names, held, strict=True) if h]
    import os

    top = storage.local_path()
    assert top is not None
    found: list[Found] = []

    def walk(rel: str, depth: int) -> None:
        path = os.path.join(top, rel) if rel else top
        try:
            names = set(os.listdir(path))
        except OSError:
            return
        kind = folder_kind(names, lambda n: os.path.isdir(os.path.join(path, n)))
        if kind is None and "checkpoint" in names and deepspeed_folder(path):
            kind = LIGHTNING  # Lightning's DeepSpeedStrategy folder (converters/lightning_deepspeed.py)
        if kind is not None:
            found.append(Found(rel, kind))
            return
        for name in sorted(n for n in names if n.endswith(".ckpt")):
            rel_file = f"{rel}/{name}" if rel else name
            if file_tool(os.path.join(path, name)) is not None:
                found.append(Found(rel_file, LIGHTNING))
        if depth >= max_depth:
            return
        for name in sorted(names):
            if not name.startswith(".") and os.path.isdir(os.path.join(path, name)):
                walk(f"{rel}/{name}" if rel else name, depth + 1)

    walk("", 0)
    return found


def inspect_any(root: Storage, rel: str, check_files: bool = False) -> CheckpointInfo:
    """:func:`inspect_dir` for one of our checkpoints at any path below ``root`` (its step from its manifest; a
    ``step_<N>`` folder must hold step N)."""
    name = rel.rsplit("/", 1)[-1]
    if parse_step(name) is not None:
        info = inspect_dir(root.child(rel.rsplit("/", 1)[0]) if "/" in rel else root, name, check_files)
        return CheckpointInfo(info.step, rel, info.status, info.manifest, info.error)
    sub = root.child(rel)
    try:
        m = read_manifest(sub, full=False)
    except CkptError as e:
        return CheckpointInfo(None, rel, "damaged", error=str(e))
    if check_files:
        bad = missing_files(sub, m)
        if bad:
            return CheckpointInfo(m.step, rel, "damaged", m, f"{sub.display()}: " + ", ".join(bad[:4]))
    return CheckpointInfo(m.step, rel, "committed", m)
