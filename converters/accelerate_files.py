"""The files of an accelerate ``Accelerator.save_state`` folder, and what each holds (accelerate 1.x).

``save_accelerator_state`` writes, for ``i`` > 0 with an ``_i`` suffix: ``model.safetensors`` (or
``pytorch_model.bin`` with ``safe_serialization=False``) per prepared model, ``optimizer.bin`` (a torch optimizer
``state_dict``: parameters *numbered*), ``scheduler.bin``, ``sampler.bin`` (a pickled ``SeedableRandomSampler``,
only for an ``IterableDatasetShard`` loader; read and written by :mod:`.accelerate_sampler`),
``dl_state_dict.bin`` (a ``StatefulDataLoader``'s ``state_dict``, with ``use_stateful_dataloader=True``),
``scaler.pt`` (a ``GradScaler``'s), ``random_states_{process}.pkl`` (``step``, ``random_state``,
``numpy_random_seed``, ``torch_manual_seed``, ``torch_<device>_manual_seed``, ``xm_seed``) and
``custom_checkpoint_{i}.pkl`` (the ``state_dict`` of each ``register_for_checkpointing`` object).  All but the
model are ``torch.save`` pickles, read here through :func:`ckpt.safe_unpickle.load_torch_file`: NumPy's RNG state is
an allow-listed addition (:data:`NUMPY_RNG`), the sampler's three classes the other (inert stand-ins,
:data:`.accelerate_sampler.ALLOWED`); anything else is refused naming its global.

The optimizer's numbering is the one fact the files do not say (safetensors stores names sorted, not in
``named_parameters()`` order): :func:`name_optimizer_params` names each number from the model config (``--config``:
the model rebuilt on the meta device, parameters in their order) or, without one, from moment shapes when each
shape belongs to exactly one model tensor; anything else is refused rather than guessed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckpt.errors import CkptError, LayoutError
from ckpt.format import treecodec
from ckpt.safe_unpickle import load_torch_file

SAFE_MODEL = "model.safetensors"
BIN_MODEL = "pytorch_model.bin"
OPTIMIZER = "optimizer.bin"
SCHEDULER = "scheduler.bin"
SAMPLER = "sampler.bin"
DL_STATE = "dl_state_dict.bin"
SCALER = "scaler.pt"
#: every name save_state writes but the models (``{i}``: a process index or a registration index)
_STATE_FILE = re.compile(
    r"(optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.bin|scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl"
)
_MODEL_FILE = re.compile(r"(model|pytorch_model)(_(\d+))?\.(safetensors|bin)")
_RNG_FILE = re.compile(r"random_states_(\d+)\.pkl")
_CUSTOM_FILE = re.compile(r"custom_checkpoint_(\d+)\.pkl")

_np_core = getattr(np, "_core", None) or np.core  # numpy 2 moved numpy.core to numpy._core
#: the globals ``np.random.get_state()`` pickles (a uint32 ndarray), under either NumPy major version's module
NUMPY_RNG: dict[tuple[str, str], Any] = {
    ("numpy._core.multiarray", "_reconstruct"): _np_core.multiarray._reconstruct,
    ("numpy.core.multiarray", "_reconstruct"): _np_core.multiarray._reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}
if hasattr(np, "dtypes"):  # numpy >= 1.25 pickles the dtype's class
    NUMPY_RNG[("numpy.dtypes", "UInt32DType")] = np.dtypes.UInt32DType

#: accelerate's RNG keys -> ours (:data:`ckpt.state.rng.BUILT_IN`); other keys are kept under their own name
_RNG_KEYS = {"random_state": "python", "numpy_random_seed": "numpy", "torch_manual_seed": "torch",
             "torch_cuda_manual_seed": "cuda"}  # fmt: skip
_RNG_BACK = {v: k for k, v in _RNG_KEYS.items()}


#: written by ckpt.integrations.accelerate into a save_state folder whose model it saved as a step of ours
POINTER = "ckpt_step.json"


def pointed_model(root: Path) -> Any:
    """The model tensors of a folder whose ``ckpt_step.json`` points at a step of ours: its ``ManifestSource``
    with the model tensors only (the rest is in accelerate's files beside the pointer)."""
    import json

    from ckpt.restoring.discovery import step_dir

    from .ckpt import open_source

    try:
        doc = json.loads((root / POINTER).read_text())
        step = f"{str(doc['root']).rstrip('/')}/{step_dir(int(doc['step']))}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CkptError(f"{root / POINTER}: not a ckpt step pointer ({type(e).__name__}: {e})") from None
    src = open_source(step, config=None, storage_options=None)
    src.tensors = {n: d for n, d in src.tensors.items() if d.role != "optimizer_state"}
    return src


def is_state_file(name: str) -> bool:
    """A name only ``save_state`` writes (what marks an accelerate folder beside its model file)."""
    return _STATE_FILE.fullmatch(name) is not None


def model_files(names: Sequence[str], where: str) -> list[str]:
    """The model files in index order (``model.safetensors``, ``model_1.safetensors``, ...); one per index."""
    by_index: dict[int, list[str]] = {}
    for n in names:
        m = _MODEL_FILE.fullmatch(n)
        if m:
            by_index.setdefault(int(m.group(3) or 0), []).append(n)
    for i, found in by_index.items():
        if len(found) > 1:
            raise CkptError(
                f"{where}: model {i} is saved twice ({', '.join(sorted(found))}); expected one file"
            )
    if by_index and sorted(by_index) != list(range(len(by_index))):
        raise CkptError(
            f"{where}: model files {sorted(n for v in by_index.values() for n in v)} skip an index"
        )
    return [by_index[i][0] for i in sorted(by_index)]


def model_file_name(index: int, safe: bool = True) -> str:
    base = SAFE_MODEL if safe else BIN_MODEL
    return base if index == 0 else base.replace(".", f"_{index}.")


def load(path: Path, allowed: Mapping[tuple[str, str], Any] | None = None, *, mmap: bool = False) -> Any:
    """``path`` through the safe unpickler (weights_only + ``allowed``)."""
    return load_torch_file(path, allowed, mmap=mmap)


def read_rng(root: Path, names: Sequence[str]) -> tuple[dict[str, Any], dict[str, int]]:
    """``(rng trees by process, accelerate's step counter by process)`` from the ``random_states_*.pkl`` files."""
    rng: dict[str, Any] = {}
    steps: dict[str, int] = {}
    for n in sorted(names):
        m = _RNG_FILE.fullmatch(n)
        if not m:
            continue
        st = load(root / n, NUMPY_RNG)
        if not isinstance(st, dict) or "random_state" not in st:
            raise CkptError(f"{root / n}: not accelerate's RNG state (no random_state)")
        rank = str(int(m.group(1)))
        if "step" in st:
            steps[rank] = int(st["step"])
        rec = {_RNG_KEYS.get(k, k): v for k, v in st.items() if k != "step"}
        rng[rank] = treecodec.encode(rec, f"rng.{n}")
    return rng, steps


def rng_files(
    rng: Mapping[str, Any], steps: Mapping[str, int], default_step: int
) -> dict[str, dict[str, Any]]:
    """Inverse of :func:`read_rng`: ``{file name: dict as save_state writes it}``."""
    out = {}
    for rank, rec in sorted(rng.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
        r = treecodec.decode(rec)
        st: dict[str, Any] = {"step": int(steps.get(str(rank), default_step))}
        st.update({_RNG_BACK.get(k, k): v for k, v in r.items()})
        out[f"random_states_{rank}.pkl"] = st
    return out


def custom_states(root: Path, names: Sequence[str]) -> dict[str, Any]:
    """The ``custom_checkpoint_{i}.pkl`` state dicts (encoded), by index: plain containers and tensors only."""
    out = {}
    for n in names:
        m = _CUSTOM_FILE.fullmatch(n)
        if m:
            out[str(int(m.group(1)))] = treecodec.encode(load(root / n), f"extra.accelerate.{n}")
    return out


def model_order(config: Mapping[str, Any], where: str) -> list[str]:
    """The trainable parameters of the HF model ``config`` describes, in ``named_parameters()`` order (built on
    the meta device: no memory, no weights)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise CkptError(
            f"{where}: naming the optimizer's parameters from --config needs transformers"
        ) from None
    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise LayoutError(f"{where}: the config has no model_type; cannot rebuild the parameter order")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    except Exception as e:  # noqa: BLE001 - transformers' own refusal (unknown type, bad field), as one line
        said = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise LayoutError(
            f"{where}: --config model_type {model_type!r}: transformers cannot build a causal LM from it ({said}); "
            "cannot rebuild the parameter order"
        ) from None
    return [n for n, p in model.named_parameters() if p.requires_grad]


def name_optimizer_params(
    path: Path, opt: Any, shapes: Mapping[str, tuple[int, ...]], order: list[str] | None
) -> dict[int, str]:
    """``{parameter number: model tensor name}`` for the optimizer state dict ``opt`` read from ``path``.

    ``order``: the model's parameters in ``named_parameters()`` order (from ``--config``): the numbers, in
    param_group order, are those names in that order (``optimizer(model.parameters())``).  Without it each number is
    named by its moment's shape when exactly one model tensor has that shape and no other number does; numbers
    with no state at all (SGD without momentum, a step not taken yet) by the model tensors left, when they are all
    in one param_group and exactly as many (their order then changes nothing)."""
    if not isinstance(opt, dict) or "param_groups" not in opt or "state" not in opt:
        raise CkptError(f"{path}: not a torch optimizer state dict (no param_groups/state)")
    ids = [i for g in opt["param_groups"] for i in g["params"]]
    if order is not None:
        if len(ids) != len(order):
            raise LayoutError(
                f"{path}: {len(ids)} parameters in param_groups, the --config model has {len(order)} trainable "
                "ones; cannot name them"
            )
        named = dict(zip(ids, order, strict=True))
        missing = sorted(set(order) - set(shapes))
        if missing:
            raise LayoutError(
                f"{path}: the --config model has parameters the model file lacks ({', '.join(missing[:3])})"
            )
        for i, per in opt["state"].items():
            for key, value in per.items():
                if _moment(value) and tuple(value.shape) != shapes[named[i]]:
                    raise LayoutError(
                        f"{path}: {key} of parameter {i} has shape {list(value.shape)}, the --config order names it "
                        f"{named[i]} {list(shapes[named[i]])}; the optimizer was not built over model.parameters()"
                    )
        return named
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for n, s in shapes.items():
        by_shape.setdefault(tuple(s), []).append(n)
    shape_of: dict[int, tuple[int, ...]] = {}
    stateless = []
    for i in ids:
        moments = [v for v in opt["state"].get(i, {}).values() if _moment(v)]
        if moments:
            shape_of[i] = tuple(moments[0].shape)
        elif opt["state"].get(i):
            raise LayoutError(
                f"{path}: parameter {i} has optimizer state but no moment tensor, so nothing says which tensor it "
                "is; pass --config config.json (the HF model config) to name the parameters in model order"
            )
        else:
            stateless.append(i)
    named = {}
    counts: dict[tuple[int, ...], int] = {}
    for s in shape_of.values():
        counts[s] = counts.get(s, 0) + 1
    for i, s in shape_of.items():
        holders = by_shape.get(s, [])
        if len(holders) != 1 or counts[s] != 1:
            raise LayoutError(
                f"{path}: parameter {i}'s moments have shape {list(s)}, which {len(holders)} model tensor(s) and "
                f"{counts[s]} optimizer parameter(s) have; pass --config config.json (the HF model config) to name "
                "the parameters in model order"
            )
        named[i] = holders[0]
    if stateless:
        # no state to carry: only their group matters, so they are named when they are all in one group and are
        # exactly the model tensors left (then any order restores the same optimizer)
        rest = [n for n in shapes if n not in named.values()]
        groups = {gi for gi, g in enumerate(opt["param_groups"]) for i in g["params"] if i in stateless}
        if len(groups) != 1 or len(rest) != len(stateless):
            raise LayoutError(
                f"{path}: {len(stateless)} parameters have no optimizer state yet and {len(rest)} model tensors "
                "are left to name them by; pass --config config.json (the HF model config) to name the "
                "parameters in model order"
            )
        named.update(zip(stateless, rest, strict=True))
    return named


def _moment(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


__all__ = [
    "BIN_MODEL", "DL_STATE", "NUMPY_RNG", "OPTIMIZER", "POINTER", "SAFE_MODEL", "SAMPLER", "SCALER", "SCHEDULER",
    "custom_states", "is_state_file", "load", "model_file_name", "model_files", "model_order",
    "name_optimizer_params", "pointed_model", "read_rng", "rng_files",
]  # fmt: skip
