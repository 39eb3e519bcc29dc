"""Checkpoints of other training tools, recognised from names so that no command mistakes them for nothing.

An accelerate ``save_state`` folder (:func:`folder_tool`) and a Lightning ``.ckpt`` file (:func:`file_tool`) are
recognised here and read by ``converters/accelerate.py`` and ``converters/lightning.py``; the tools in
:data:`KINDS` (none today) are not read yet.

An accelerate ``Accelerator.save_state`` folder (``model.safetensors``, ``optimizer.bin``, ``random_states_0.pkl``)
and a PyTorch Lightning ``.ckpt`` file used to get "no checkpoints" (exit 0) from ``ls`` and "manifest.json
missing" from ``inspect``: a user could conclude the run saved nothing.  Every command now names what they are and
that they are not supported yet (exit 2, :data:`ckpt.errors.EXIT_CANNOT_RUN`), until they are.

Recognised from names and, for a ``.ckpt`` file, from the raw bytes of its pickle (the key
``pytorch-lightning_version`` that Lightning writes first): nothing is unpickled, and no torch is imported.
"""

from __future__ import annotations

import os
import re
import zipfile

ACCELERATE = "accelerate"
LIGHTNING = "lightning"
#: the kinds no command reads yet (the ``kind`` of a :class:`~ckpt.restoring.discovery.Found`): none today.  An
#: accelerate folder and a Lightning ``.ckpt`` are recognised here and read by ``converters/accelerate.py`` and
#: ``converters/lightning.py``; a tool added here is named "not supported yet" by every command until it is read
KINDS: tuple[str, ...] = ()

#: what each is, in the words the messages use
WHAT = {
    ACCELERATE: "an accelerate save_state folder",
    LIGHTNING: "a PyTorch Lightning .ckpt file",
}
#: the short name ``ls`` shows in its format column
SHORT = {ACCELERATE: "accelerate", LIGHTNING: "Lightning"}

#: files only ``Accelerator.save_state`` writes: its RNG states and its optimizer/scheduler/sampler ``.bin`` files
_ACCELERATE_FILE = re.compile(r"random_states_\d+\.pkl|(optimizer|scheduler|sampler)(_\d+)?\.bin")
#: what Lightning's ``dump_checkpoint`` puts in every checkpoint's pickle
_LIGHTNING_KEY = b"pytorch-lightning_version"


def folder_tool(names: set[str] | list[str]) -> str | None:
    """:data:`ACCELERATE` when a folder's listing is an accelerate ``save_state`` folder, else None."""
    return ACCELERATE if any(_ACCELERATE_FILE.fullmatch(n) for n in names) else None


def file_tool(path: str) -> str | None:
    """:data:`LIGHTNING` when the local file ``path`` is a Lightning checkpoint, else None (a few KiB read)."""
    if not path.endswith(".ckpt") or not os.path.isfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as z:
            pickles = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if not pickles:
                return None
            with z.open(pickles[0]) as f:
                head = f.read(1 << 16)
    except (OSError, zipfile.BadZipFile):
        return None
    return LIGHTNING if _LIGHTNING_KEY in head else None


#: the tag Lightning's DeepSpeedStrategy saves under (``engine.save_checkpoint(path, tag="checkpoint")``)
DEEPSPEED_TAG = "checkpoint"


def deepspeed_folder(path: str) -> bool:
    """Whether the local folder ``path`` is what Lightning's DeepSpeedStrategy writes for a ``.ckpt`` path: a
    ``checkpoint/`` folder holding DeepSpeed's ``*mp_rank_<NN>_model_states.pt`` files (one listing, nothing read;
    ``converters/lightning_deepspeed.py`` reads it)."""
    tag = os.path.join(path, DEEPSPEED_TAG)
    try:
        return any(n.endswith("_model_states.pt") and "mp_rank_" in n for n in os.listdir(tag))
    except OSError:
        return False


def tool_at(path: str) -> str | None:
    """Which unsupported tool wrote the local file or folder ``path`` (None: none this module knows)."""
    if os.path.isdir(path):
        try:
            tool = folder_tool(os.listdir(path))
            return tool if tool in KINDS else None
        except OSError:
            return None
    tool = file_tool(path)
    return tool if tool in KINDS else None


def not_supported(path: str, kind: str) -> str:
    """The one line every command says for ``path``, a checkpoint of ``kind`` (:data:`KINDS`)."""
    return (
        f"{path} is {WHAT[kind]}; ckpt does not read {SHORT[kind]} checkpoints yet (it reads its own, NxD tags, "
        "Hugging Face, Trainer, PEFT, accelerate and Lightning checkpoints, DCP)"
    )


__all__ = ["ACCELERATE", "DEEPSPEED_TAG", "KINDS", "LIGHTNING", "SHORT", "WHAT", "deepspeed_folder", "file_tool", "folder_tool", "not_supported", "tool_at"]
