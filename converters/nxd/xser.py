"""NxD's two file forms: a plain ``torch.save`` pickle, or torch_xla's "xser" form.

xser (``use_xser=True``): ``X.pt`` pickles the structure with every tensor replaced by
``torch_xla.utils.serialization.TensorReference(tid)``; tensor ``tid`` is its own ``torch.save`` file
``X.pt.tensors/tensor_<tid>.pt``; NxD >= 0.7 also writes ``X.pt.info.pt`` = ``{tid: {dtype, shape,
expert_model_parallel}}``.  tids are assigned depth-first in dict order.  With expert parallelism NxD writes each
non-expert tensor once, in the ``ep_rank_00`` file's folder, so readers of another ep rank fall back to it.

Everything here reads through :func:`ckpt.safe_unpickle.load_torch_file` (never imports torch_xla) and writes the
stand-in :class:`~ckpt.safe_unpickle.TensorReference` under torch_xla's exact global name.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import tempfile
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CorruptionError
from ckpt.safe_unpickle import XSER_TENSOR_REFERENCE, TensorReference, load_torch_file
from ckpt.storage import Storage
from ckpt.storage.refusal import naming

from .integrity import verify_torch_zip

_GLOBAL_LINE = f"{XSER_TENSOR_REFERENCE[0]}\n{XSER_TENSOR_REFERENCE[1]}\n".encode()


def tensors_dir(path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(path)}.tensors")


def info_path(path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(path)}.info.pt")


def tensor_file(path: str | os.PathLike[str], tid: int) -> Path:
    return tensors_dir(path) / f"tensor_{tid}.pt"


def map_structure(obj: Any, fn: Callable[[Any], Any], select: Callable[[Any], bool]) -> Any:
    """Rebuild dicts/lists/tuples depth-first (dict order), replacing leaves for which ``select`` holds by ``fn``."""
    if select(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_structure(v, fn, select) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_structure(v, fn, select) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(map_structure(v, fn, select) for v in obj)
    return obj


def collect_refs(obj: Any) -> list[TensorReference]:
    """All TensorReference leaves of a ref structure, depth-first."""
    found: list[TensorReference] = []

    def keep(r: Any) -> Any:
        found.append(r)
        return r

    map_structure(obj, keep, lambda v: isinstance(v, TensorReference))
    return found


def can_mmap(path: str | os.PathLike[str]) -> bool:
    """Whether ``torch.load(mmap=True)`` can read ``path``: zip-format ``torch.save`` files only (legacy pickles are
    read whole)."""
    return zipfile.is_zipfile(path)


def load_checked(
    path: str | os.PathLike[str], *, verify: bool = True, context: str = "", mmap: bool = False
) -> Any:
    """:func:`load_torch_file` after checking the zip members' CRC32s (``verify``; see :mod:`.integrity`).

    Files that are not zips (legacy ``torch.save`` pickles) are loaded without a CRC check, and read whole even with
    ``mmap`` (which keeps a zip's tensors in the page cache: no anonymous memory however big the file).
    """
    if verify:
        verify_torch_zip(path, context=context)
    return load_torch_file(path, mmap=mmap and can_mmap(path))


def ref_names(obj: Any) -> dict[int, str]:
    """tid -> where its TensorReference sits in a ref structure (``key/key/index``), for error messages."""
    names: dict[int, str] = {}

    def walk(o: Any, at: str) -> None:
        if isinstance(o, TensorReference):
            names.setdefault(o.tid, at or "<root>")
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{at}/{k}" if at else str(k))
        elif isinstance(o, (list, tuple)) and not isinstance(o, torch.Size):
            for i, v in enumerate(o):
                walk(v, f"{at}/{i}" if at else str(i))

    walk(obj, "")
    return names


def read_info(path: str | os.PathLike[str], *, verify: bool = False) -> dict[int, dict[str, Any]] | None:
    """``X.pt.info.pt`` if present (absent in NxD <= 0.6 and plain torch_xla ``xser.save`` output).

    ``verify`` checks its zip CRC32s first (off by default: ``ckpt ls`` reads it and must stay cheap).
    """
    p = info_path(path)
    if not p.is_file():
        return None
    info = load_checked(p, verify=verify)
    if not isinstance(info, dict):
        raise CorruptionError(f"{p}: expected a dict tid -> {{dtype, shape}}, got {type(info).__name__}")
    return info


def ep00_path(path: Path) -> Path | None:
    """The ``ep_rank_00`` twin of an ep-rank file, where NxD keeps the non-expert tensors; None without ep field."""
    name = re.sub(r"ep_rank_\d{2}", "ep_rank_00", path.name)
    return None if name == path.name else path.with_name(name)


def load_xser_tensor(
    path: Path,
    tid: int,
    info: dict[int, dict[str, Any]] | None,
    *,
    mmap: bool = False,
    verify: bool = True,
    context: str = "",
) -> torch.Tensor | None:
    """Tensor ``tid`` of xser file ``path``; None when its file is absent (checked against info by the caller).

    ``verify`` checks the tensor file's zip CRC32s before loading it (``context`` goes into the error message).
    """
    candidates = [tensor_file(path, tid)]
    ep00 = ep00_path(path)
    if ep00 is not None and not (info and info.get(tid, {}).get("expert_model_parallel")):
        candidates.append(tensor_file(ep00, tid))
    for f in candidates:
        if f.is_file():
            t = load_checked(f, verify=verify, context=context, mmap=mmap)
            if not isinstance(t, torch.Tensor):
                raise CorruptionError(f"{f}: expected one tensor, got {type(t).__name__}")
            if info is not None and tid in info:
                exp = info[tid]
                if exp.get("dtype") is not None and t.dtype != exp["dtype"]:
                    raise CorruptionError(
                        f"{f}: dtype {t.dtype} but {info_path(path).name} says {exp['dtype']}"
                    )
                if exp.get("shape") is not None and tuple(t.shape) != tuple(exp["shape"]):
                    raise CorruptionError(
                        f"{f}: shape {list(t.shape)} but {info_path(path).name} says {list(exp['shape'])}"
                    )
            return t
    return None


def load_nxd_file(
    path: str | os.PathLike[str],
    xser: bool,
    *,
    mmap: bool = False,
    missing: Callable[[TensorReference], torch.Tensor] | None = None,
    verify: bool = True,
    context: str = "",
) -> Any:
    """Load one NxD file (plain or xser) with every tensor materialised on the CPU.

    ``missing`` is asked for tensors whose ``tensor_<tid>.pt`` is absent (NxD's
    ``avoid_saving_lower_precision_weights`` leaves model tensors out); without it an absent file is an error.

    ``verify`` (default on) checks the zip CRC32 of every member of every file read (the ref/plain file, each
    ``tensor_<tid>.pt``, ``.info.pt``) before loading it, and raises :class:`CorruptionError` naming the file,
    ``context`` (e.g. the rank) and, for xser tensor files, the tensor.  Non-zip (legacy) files are not checked.
    """
    path = Path(path)
    obj = load_checked(path, verify=verify, context=context, mmap=mmap and not xser)
    if not xser:
        return obj
    info = read_info(path, verify=verify)
    names = ref_names(obj) if verify else {}

    def resolve(ref: TensorReference) -> torch.Tensor:
        where = f"tensor {ref.tid} '{names.get(ref.tid, '?')}' of {path.name}"
        t = load_xser_tensor(
            path, ref.tid, info, mmap=mmap, verify=verify, context=f"{where}, {context}" if context else where
        )
        if t is None:
            if missing is not None:
                return missing(ref)
            raise CorruptionError(f"{tensor_file(path, ref.tid)}: missing (referenced by {path.name})")
        return t

    return map_structure(obj, resolve, lambda v: isinstance(v, TensorReference))


# ----------------------------------------------------------------------------------------------------- writing


class _XserPickler(pickle._Pickler):  # type: ignore[name-defined]
    """Pickler that writes our stand-in class as the global ``torch_xla.utils.serialization.TensorReference``.

    The stock pickler would import the class's module to verify it (importing torch_xla, or failing without it);
    this one writes the GLOBAL opcode directly.  It is the pure-Python pickler, used only for the small ref files
    (tensors live in their own files), so speed does not matter.
    """

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is TensorReference:
            self.write(pickle.GLOBAL + _GLOBAL_LINE)
            self.memoize(obj)
            return
        super().save_global(obj, name)


_xser_pickle_module = types.ModuleType("ckpt_nxd_xser_pickle")
_xser_pickle_module.Pickler = _XserPickler  # type: ignore[attr-defined]


def split_tensors(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """Replace tensors by TensorReference(tid) depth-first (one tid per distinct tensor object, as torch_xla does)."""
    tensors: list[torch.Tensor] = []
    ids: dict[int, int] = {}

    def ref(t: torch.Tensor) -> TensorReference:
        tid = ids.get(id(t))
        if tid is None:
            tid = ids[id(t)] = len(tensors)
            tensors.append(t)
        return TensorReference(tid)

    return map_structure(obj, ref, lambda v: isinstance(v, torch.Tensor)), tensors


def compact(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns exactly its bytes (torch.save of a view would write the whole base storage)."""
    t = t.detach().cpu()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()
    return t


def _save(obj: Any, storage: Storage, rel: str, **kw: Any) -> None:
    """``torch.save`` of ``obj`` as ``rel``, to a real file of that name.

    ``torch.save`` names the zip records after the file (``<stem>/data.pkl``) when given a path and ``archive/``
    when given a stream, so the file is always written under its final name (NxD's files, byte for byte): directly
    inside a local folder transaction, else in a local temp folder and then published whole to the object store.
    """
    path = storage.local_path(rel)
    if path is not None:
        with naming(path):  # torch's "unexpected pos" on a full disk: an OSError naming the file
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(obj, path, **kw)
        return
    with tempfile.TemporaryDirectory(prefix="ckpt-nxd-") as d:
        local = os.path.join(d, os.path.basename(rel))
        with naming(local):  # the local temp folder is full
            torch.save(obj, local, **kw)
        with open(local, "rb") as src, storage.create(rel) as dst:
            shutil.copyfileobj(src, dst, 16 << 20)


def save_nxd_file(
    obj: Any,
    storage: Storage,
    rel: str,
    xser: bool,
    *,
    write_info: bool = True,
    expert: frozenset[int] = frozenset(),
    shared_elsewhere: bool = False,
) -> None:
    """Write ``obj`` as ``rel`` under ``storage`` the way NxD's ``save_checkpoint`` does: one ``torch.save`` file, or
    xser (the ref file, ``<rel>.tensors/tensor_<tid>.pt`` per tensor, ``<rel>.info.pt``).

    Expert parallelism (xser only): ``expert`` holds the ``id()`` of the tensors that are this EP rank's own (NxD's
    ``expert_model_parallel``, recorded in ``.info.pt``); with ``shared_elsewhere`` (EP rank > 0) the other tensors'
    files are left out, as NxD writes them once under ``ep_rank_00`` and every EP rank loads them from there."""
    if not xser:
        _save(obj, storage, rel)
        return
    ref_obj, tensors = split_tensors(obj)
    info: dict[int, dict[str, Any]] = {}
    for tid, t in enumerate(tensors):
        own = id(t) in expert
        if own or not shared_elsewhere:
            _save(compact(t), storage, f"{rel}.tensors/tensor_{tid}.pt")
        info[tid] = {"dtype": t.dtype, "shape": t.shape, "expert_model_parallel": own}
    _save(ref_obj, storage, rel, pickle_module=_xser_pickle_module)
    if write_info:
        _save(info, storage, f"{rel}.info.pt")
