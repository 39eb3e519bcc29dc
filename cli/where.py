"""What a path a user gave actually is, when it is not what the command wanted: one line saying what to run.

``ckpt ls`` wants a folder of checkpoints, ``inspect`` / ``verify`` one checkpoint; users point one level too high
or too low (a run directory, a checkpoint, its ``manifest.json``).  These checks read only listings and small
files (no torch).
"""

from __future__ import annotations

import os
from typing import Any

from ckpt.format.manifest import MANIFEST_NAME
from ckpt.restoring.discovery import parse_step
from ckpt.words import holds_not_one


def _steps(storage: Any) -> list[str]:
    """Our checkpoints directly under ``storage``: ``step_<N>`` folders holding a manifest."""
    try:
        return sorted(
            n for n in storage.listdir() if parse_step(n) is not None and storage.exists(f"{n}/{MANIFEST_NAME}")
        )
    except Exception:  # noqa: BLE001 - a listing that fails says nothing about the level
        return []


def might_be_nxd(storage: Any) -> bool:
    """Cheap (listings only, no torch): could this local folder be an NxD tag or a folder of tags?"""
    if not storage.local:
        return False
    try:
        names = storage.listdir()
        return "model" in names or any(storage.is_dir(f"{n}/model") for n in names)
    except Exception:  # noqa: BLE001
        return False


def _kind(storage: Any) -> str | None:
    """``"checkpoint"``, ``"hf"``, ``"dcp"``, ``"adapter"``, ``"nxd"`` or None for a folder that is one checkpoint."""
    try:
        names = set(storage.listdir())
    except Exception:  # noqa: BLE001
        return None
    if MANIFEST_NAME in names:
        return "checkpoint"
    if ".metadata" in names:
        return "dcp"  # Lightning's FSDP sharded folder too (its meta.pt read by converters.lightning_folders)
    if "checkpoint" in names and storage.local:
        from ckpt.restoring.other_tools import deepspeed_folder

        if deepspeed_folder(storage.local_path()):
            return "lightning"  # Lightning's DeepSpeed folder: read by converters/lightning_deepspeed.py
    if "adapter_config.json" in names and "adapter_model.safetensors" in names:
        return "adapter"  # a PEFT folder, or a Trainer's LoRA checkpoint-N
    from ckpt.restoring.other_tools import ACCELERATE, folder_tool

    if folder_tool(names) == ACCELERATE and "trainer_state.json" not in names:
        return "accelerate"  # a save_state folder, also when the model's config.json is beside it
    if "config.json" in names and any(n.endswith(".safetensors") or n.endswith(".index.json") for n in names):
        return "hf"
    if "model" in names and ("done" in names or "checkpoint" in names or storage.local):
        try:
            if any(n.startswith(("dp_rank_", "tp_rank_")) for n in storage.child("model").listdir()):
                return "nxd"
        except Exception:  # noqa: BLE001
            return None
    return None


_KIND_WORDS = {
    "checkpoint": "a checkpoint",
    "hf": "a Hugging Face model folder",
    "dcp": "a DCP checkpoint",
    "nxd": "an NxD tag",
    "accelerate": "an accelerate save_state folder",
}


def explain_empty_root(root: str, storage: Any) -> str | None:
    """For ``ckpt ls ROOT`` finding no checkpoints: why, and what to run instead (None: ROOT is just empty)."""
    kind = _kind(storage)
    if kind is not None:
        return f"{root} is {_KIND_WORDS[kind]}, not a folder of checkpoints; run: ckpt inspect {root}"
    for sub in ("checkpoints", "ckpt", "checkpoint"):
        if storage.is_dir(sub) and _steps(storage.child(sub)):
            return f"no checkpoints directly under {root}, but {sub}/ holds them; run: ckpt ls {root}/{sub}"
    return None


def explain_not_a_checkpoint(path: str, storage: Any, command: str) -> str | None:
    """For ``inspect`` / ``verify`` PATH without a manifest: PATH is a folder of checkpoints, a run directory, or a
    part of an NxD tag."""
    here = storage.local_path() if storage.local else None
    if here is not None and os.path.basename(here.rstrip("/")) in (
        "model",
        "optim",
    ):  # imports torch: only then
        from ckpt.converters.nxd.naming import part_of_tag

        part = part_of_tag(here)
        if part is not None:
            return part.replace("point at the whole tag: ", f"run: ckpt {command} ")
    steps = _steps(storage)
    if steps:
        return f"{holds_not_one(path, steps, 'checkpoint', f'ckpt {command}')} (or ckpt ls {path})"
    for sub in ("checkpoints", "ckpt", "checkpoint"):
        if storage.is_dir(sub) and _steps(storage.child(sub)):
            return f"{path} is a run directory; its checkpoints are in {sub}/; run: ckpt ls {path}/{sub}"
    return None


def strip_manifest(path: str) -> str:
    """``.../step_5/manifest.json`` names the checkpoint ``.../step_5``."""
    trimmed = path.rstrip("/")
    if trimmed.endswith("/" + MANIFEST_NAME) or trimmed == MANIFEST_NAME:
        return trimmed[: -len(MANIFEST_NAME)].rstrip("/") or "."
    return path


def _a_file(path: str, command: str) -> str:
    """``ckpt inspect model.safetensors``: a file, where a checkpoint folder was expected; name the folder when it is
    a checkpoint."""
    from ckpt.storage import open_storage

    folder = os.path.dirname(os.path.abspath(path))
    kind = _kind(open_storage(folder))
    if kind is not None:
        return f"{path} is a file of {_KIND_WORDS[kind]}; ckpt {command} takes the folder: run: ckpt {command} {folder}"
    return f"{path} is a file; ckpt {command} takes a checkpoint folder"


def resolve_checkpoint(path: str, command: str) -> tuple[str, str]:
    """``(path, kind)`` of what ``inspect`` / ``verify`` was pointed at: ``"checkpoint"`` (ours; also for any path
    this cannot list, whose reader then says what is wrong), ``"nxd"``, ``"hf"`` or ``"dcp"``.  A folder of
    checkpoints or a run directory is refused with what to run instead."""
    from ckpt.errors import CkptError
    from ckpt.restoring.other_tools import LIGHTNING, file_tool, not_supported, tool_at
    from ckpt.storage import open_storage

    path = strip_manifest(path)
    storage = open_storage(path)
    if storage.local and os.path.isfile(path):
        other = file_tool(path)
        if other == LIGHTNING:  # read by ckpt.converters.lightning (through the safe unpickler)
            return path, LIGHTNING
        raise CkptError(not_supported(path, other) if other is not None else _a_file(path, command))
    try:
        if not storage.is_dir():
            return path, "checkpoint"
    except Exception:  # noqa: BLE001 - the reader reports an unreachable path in its own words
        return path, "checkpoint"
    kind = _kind(storage)
    if kind is not None:
        return path, kind
    other = tool_at(path) if storage.local else None  # after ours and HF's: a Trainer folder may hold optimizer.bin
    if other is not None:
        raise CkptError(not_supported(path, other))
    why = explain_not_a_checkpoint(path, storage, command)
    if why is not None:
        raise CkptError(why)
    if might_be_nxd(storage):
        from ckpt.converters.nxd import summary as nxd_summary  # torch: only for a folder that is not ours

        if nxd_summary.is_nxd_dir(path):
            tags = nxd_summary.list_nxd(path)
            if len(tags) == 1 and tags[0]["tag"] == path.rstrip("/").rsplit("/", 1)[-1]:
                return path, "nxd"
            names = [t["tag"] for t in tags]
            if names:
                raise CkptError(
                    f"{holds_not_one(path, names, 'NxD tag', f'ckpt {command}')} (or ckpt ls {path})"
                )
    return path, "checkpoint"
