"""The one reader of a Hugging Face model folder's shard list: the index held against the shards' own headers.

``model.safetensors.index.json`` says which shard holds each tensor, and each shard's safetensors header says what
it holds.  A tool that rewrote one and not the other (a hand-merged index, a shard renamed or re-saved) leaves them
disagreeing, and a reader that trusts either one alone drops or mislocates a tensor without a word: ``convert``
would write an output without ``lm_head.weight`` and ``verify`` would call both folders sound.  So every reader of
an HF folder (:class:`.hf.HFSource`, hence ``inspect``, ``verify``, ``ls``, ``diff``, ``convert`` and Trainer
folders; ``--merge-lora``) opens it through :func:`hf_tensors`, which refuses, in one line naming the tensor and the
shards, a name the index maps to a shard that does not hold it, a name in a shard but not in the index, and a name
in two shards.  Shards the index does not list but that carry HF's shard names (``model.safetensors``,
``model-0000i-of-0000n.safetensors``) are read too, so that a tensor the index lost is found where it really is.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt.errors import CorruptionError
from ckpt.words import count

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: the file names ``save_pretrained`` gives model weights (a stray one beside an index is read too)
_SHARD_NAME = re.compile(r"model(-\d+-of-\d+)?\.safetensors")


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (no tensor data read), checked against the file's size.

    A truncated file (an interrupted download or copy) is refused here, before any planning: its header is intact
    but the data it describes ends past the end of the file.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise CorruptionError(f"{path}: shard file missing") from None
    except OSError as e:
        raise CorruptionError(f"{path}: cannot read ({e.strerror})") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise CorruptionError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20 or 8 + n > size:
            raise CorruptionError(
                f"{path}: safetensors header of {n} bytes does not fit the {size}-byte file"
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CorruptionError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CorruptionError(f"{path}: safetensors header is not a JSON object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in entry["data_offsets"])
            tuple(int(d) for d in entry["shape"])
            str(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise CorruptionError(f"{path}: tensor {name!r}: malformed safetensors header entry") from None
        if not 0 <= begin <= stop:
            raise CorruptionError(f"{path}: tensor {name!r}: bad data offsets [{begin}, {stop}]")
        end = max(end, stop)
    if 8 + n + end > size:
        raise CorruptionError(
            f"{path}: truncated: the header describes {8 + n + end} bytes, the file has {size} "
            "(an interrupted download or copy? fetch the file again)"
        )
    return header


def read_json(path: Path, what: str) -> Any:
    """A JSON file of the HF folder, or one line naming it."""
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptionError(f"{path}: {what} is not valid JSON ({e}); fix or replace the file") from None
    except OSError as e:
        raise CorruptionError(f"{path}: cannot read {what} ({e.strerror})") from None


@dataclass(frozen=True)
class HFTensor:
    """Where one tensor of an HF folder is: its shard file and its entry in that shard's header."""

    file: Path
    entry: dict[str, Any]


def _weight_map(index_path: Path) -> dict[str, str]:
    index = read_json(index_path, INDEX_NAME)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptionError(f"{index_path}: expected a 'weight_map' of tensor name -> file name")
    for fname in dict.fromkeys(weight_map.values()):
        if Path(fname).is_absolute() or ".." in Path(fname).parts:
            raise CorruptionError(f"{index_path}: unsafe shard name {fname!r}")
    return weight_map


def _mismatches(weight_map: dict[str, str], holders: dict[str, list[str]], listed: set[str]) -> list[str]:
    """Each disagreement between the index and the shard headers, as a phrase naming the tensor and the shards."""
    out = []

    def where(fname: str) -> str:
        return fname if fname in listed else f"{fname} (a shard the index does not list)"

    for name, files in holders.items():
        if len(files) > 1:
            out.append(f"tensor {name!r} is in {len(files)} shards: {', '.join(where(f) for f in files)}")
    for name, fname in weight_map.items():
        files = holders.get(name, [])
        if not files:
            out.append(f"the index maps tensor {name!r} to {fname}, which does not hold it, and no shard does")
        elif len(files) == 1 and files[0] != fname:
            out.append(f"the index maps tensor {name!r} to {fname}, but it is in {where(files[0])}")
    for name, files in holders.items():
        if name not in weight_map and len(files) == 1:
            out.append(f"tensor {name!r} is in {where(files[0])} but not in the index")
    return out


def hf_tensors(root: Path) -> dict[str, HFTensor]:
    """Every tensor of the HF model folder ``root`` (``config.json`` aside), by name, in the shards' order.

    With an index, its ``weight_map`` must agree with the shard headers exactly (see the module docstring); a
    disagreement raises :class:`~ckpt.errors.CorruptionError` (exit 1) naming the first tensor and its shards.
    Without one, the folder's weights are ``model.safetensors``.  Every header is checked against its file's size.
    """
    index_path = root / INDEX_NAME
    if not index_path.is_file():
        return {
            name: HFTensor(root / SINGLE_NAME, entry)
            for name, entry in read_header(root / SINGLE_NAME).items()
            if name != "__metadata__"
        }
    weight_map = _weight_map(index_path)
    listed = list(dict.fromkeys(weight_map.values()))
    strays = sorted(
        n for n in os.listdir(root) if _SHARD_NAME.fullmatch(n) and n not in listed and (root / n).is_file()
    )
    holders: dict[str, list[str]] = {}
    found: dict[str, HFTensor] = {}
    for fname in listed + strays:
        for name, entry in read_header(root / fname).items():
            if name == "__metadata__":
                continue
            holders.setdefault(name, []).append(fname)
            found[name] = HFTensor(root / fname, entry)
    bad = _mismatches(weight_map, holders, set(listed))
    if bad:
        more = f" (and {count(len(bad) - 1, 'more mismatch')})" if len(bad) > 1 else ""
        raise CorruptionError(
            f"{index_path}: {bad[0]}{more}; the index does not match its shards (re-save the model, or fix the "
            "index's weight_map)"
        )
    return found


__all__ = ["INDEX_NAME", "SINGLE_NAME", "HFTensor", "hf_tensors", "read_header", "read_json"]
