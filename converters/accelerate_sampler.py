"""accelerate's ``sampler.bin``: a pickled ``SeedableRandomSampler``, read as data and written back.

What accelerate does (1.16; ``checkpointing.py``): ``save_accelerator_state`` writes ``sampler.bin``
(``sampler_{i}.bin`` for data loader ``i`` > 0) with ``torch.save(sampler)`` only when the prepared loader's
``dataset`` is an ``IterableDatasetShard`` *and* its sampler (``get_sampler()``) is a ``SeedableRandomSampler``.
``prepare`` makes a ``SeedableRandomSampler`` only for a map-style dataset (``use_seedable_sampler=True``), so in
practice the file appears when a sampler was put on an iterable-dataset loader with ``set_sampler``; a map-style
loader's sampler is not saved at all (accelerate issue 3996).  ``load_accelerator_state`` reads it back through
``accelerate.utils.load``: ``torch.load(weights_only=True)`` with only NumPy's RNG globals allowed, so under
torch >= 2.6 accelerate refuses its own file (``Unsupported global: GLOBAL
accelerate.data_loader.SeedableRandomSampler``) unless the user allow-lists ``SeedableRandomSampler``,
``TensorDataset`` and ``torch.Generator`` with ``torch.serialization.add_safe_globals`` first; then it
``set_sampler``\\ s the unpickled object.  (accelerate before the weights_only switch used a plain ``torch.load``.)

What the pickle carries (the sampler's ``__dict__``): ``data_source`` (the whole dataset object: a
``TensorDataset`` pickles its tensors), ``replacement``, ``_num_samples``, ``generator`` (a ``torch.Generator``
pickled as its device, seed, offset and state; None until the sampler was first iterated), ``initial_seed`` and
``epoch``.  The next order is ``torch.randperm`` under ``manual_seed(initial_seed + epoch)``; the generator state is
carried but the next ``__iter__`` reseeds it.

Reading (:func:`read_sampler`): through :func:`ckpt.safe_unpickle.load_torch_file` with the three globals mapped to
the inert stand-ins below, whose ``__setstate__`` accepts exactly the fields above, so no accelerate code runs and no
other global is reachable.  The data source must be a ``TensorDataset`` or a plain list; any other class is refused
by the unpickler naming its global, any other allowed value (a dict, a tensor) naming its type.  Writing
(:func:`sampler_bytes`): a real ``TensorDataset`` and ``torch.Generator`` and the sampler stand-in pickled under
accelerate's own global name, field for field as accelerate writes it (accelerate is never imported).
"""

from __future__ import annotations

import hashlib
import io
import pickle
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CkptError
from ckpt.format import treecodec
from ckpt.safe_unpickle import load_torch_file

#: the globals a ``sampler.bin`` pickles
SAMPLER_GLOBAL = ("accelerate.data_loader", "SeedableRandomSampler")
TENSOR_DATASET = ("torch.utils.data.dataset", "TensorDataset")
GENERATOR = ("torch._C", "Generator")
#: the sampler's ``__dict__``, in the order ``RandomSampler.__init__`` then ``SeedableRandomSampler`` set it
FIELDS = ("data_source", "replacement", "_num_samples", "generator", "initial_seed", "epoch")


class SamplerState:
    """Stand-in for ``accelerate.data_loader.SeedableRandomSampler``: holds its fields, runs nothing."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != set(FIELDS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"SeedableRandomSampler state has fields {got}, expected {list(FIELDS)}")
        self.__dict__.update(state)


class TensorDatasetState:
    """Stand-in for ``torch.utils.data.TensorDataset``: its ``tensors`` tuple and nothing else."""

    def __setstate__(self, state: Any) -> None:
        tensors = state.get("tensors") if isinstance(state, dict) and set(state) == {"tensors"} else None
        if not isinstance(tensors, tuple) or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError("TensorDataset state must be {'tensors': (tensor, ...)}")
        if len({t.shape[0] if t.dim() else -1 for t in tensors}) > 1:
            raise ValueError("TensorDataset tensors differ in their first dimension")
        self.tensors = tensors


class GeneratorState:
    """Stand-in for ``torch.Generator`` (pickled as ``Generator(device)`` then ``(seed, offset, state)``)."""

    def __init__(self, device: Any = None) -> None:
        if device is not None and not isinstance(device, torch.device):
            raise ValueError(f"torch.Generator device must be a torch.device, got {type(device).__name__}")
        self.device = str(device or "cpu")
        self.seed: int | None = None
        self.offset: int | None = None
        self.state: torch.Tensor | None = None

    def __setstate__(self, state: Any) -> None:
        ok = isinstance(state, tuple) and len(state) == 3
        seed, offset, st = state if ok else (None, None, None)
        if not (ok and type(seed) is int and (offset is None or type(offset) is int)
                and isinstance(st, torch.Tensor) and st.dtype == torch.uint8):  # fmt: skip
            raise ValueError("torch.Generator state must be (seed, offset or None, uint8 tensor)")
        self.seed, self.offset, self.state = seed, offset, st


#: ``(module, name) -> stand-in`` for :func:`ckpt.safe_unpickle.load_torch_file`
ALLOWED: dict[tuple[str, str], Any] = {
    SAMPLER_GLOBAL: SamplerState,
    TENSOR_DATASET: TensorDatasetState,
    GENERATOR: GeneratorState,
}


def read_sampler(path: Path) -> dict[str, Any]:
    """The sampler pickled in ``path`` as a plain record (not encoded): ``initial_seed``, ``epoch``,
    ``num_samples``, ``replacement``, ``generator`` (``device``/``seed``/``offset``/``state``, or None) and
    ``data_source`` (``type``, ``length`` and its ``tensors`` or ``items``).  Anything else is refused."""
    obj = load_torch_file(path, ALLOWED)
    if not isinstance(obj, SamplerState):
        raise CkptError(f"{path}: holds a {type(obj).__name__}, expected accelerate's pickled SeedableRandomSampler")
    st = obj.__dict__
    for key in ("initial_seed", "epoch"):
        if type(st[key]) is not int:
            raise CkptError(f"{path}: the sampler's {key} is a {type(st[key]).__name__}, expected an int")
    if type(st["replacement"]) is not bool or not (st["_num_samples"] is None or type(st["_num_samples"]) is int):
        raise CkptError(f"{path}: the sampler's replacement / _num_samples are not a bool / an int or None")
    gen = st["generator"]
    if gen is not None and not isinstance(gen, GeneratorState):
        raise CkptError(f"{path}: the sampler's generator is a {type(gen).__name__}, expected a torch.Generator")
    if gen is not None and gen.state is None:
        raise CkptError(f"{path}: the sampler's torch.Generator carries no state")
    src = st["data_source"]
    if isinstance(src, TensorDatasetState):
        n = int(src.tensors[0].shape[0]) if src.tensors else 0
        data: dict[str, Any] = {"type": ".".join(TENSOR_DATASET), "length": n, "tensors": src.tensors}
    elif isinstance(src, list):
        data = {"type": "list", "length": len(src), "items": src}
    else:
        raise CkptError(
            f"{path}: the sampler's data source is a {type(src).__name__}; ckpt reads a TensorDataset or a list"
        )
    return {
        "class": ".".join(SAMPLER_GLOBAL),
        "initial_seed": st["initial_seed"],
        "epoch": st["epoch"],
        "num_samples": st["_num_samples"],
        "replacement": st["replacement"],
        "generator": None
        if gen is None
        else {"device": gen.device, "seed": gen.seed, "offset": gen.offset, "state": gen.state},
        "data_source": data,
    }


def encode(record: Mapping[str, Any]) -> Any:
    """``record`` as it travels in ``extra.accelerate.sampler`` (:mod:`ckpt.format.treecodec`)."""
    return treecodec.encode(dict(record), "extra.accelerate.sampler")


# ----------------------------------------------------------------------------------------------------- writing


class _SamplerPickler(pickle._Pickler):  # type: ignore[name-defined]
    """Writes :class:`SamplerState` as the global ``accelerate.data_loader.SeedableRandomSampler`` (the stock
    pickler would import accelerate to check the name); everything else as usual."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is SamplerState:
            self.write(pickle.GLOBAL + f"{SAMPLER_GLOBAL[0]}\n{SAMPLER_GLOBAL[1]}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)


_pickle_module = types.ModuleType("ckpt_accelerate_sampler_pickle")
_pickle_module.Pickler = _SamplerPickler  # type: ignore[attr-defined]


def sampler_bytes(encoded: Any, where: str = "extra.accelerate.sampler") -> bytes:
    """``sampler.bin`` as accelerate writes it, from the encoded record :func:`encode` made."""
    rec = treecodec.decode(encoded)
    try:
        data = rec["data_source"]
        if data["type"] == ".".join(TENSOR_DATASET):
            source: Any = torch.utils.data.TensorDataset(*data["tensors"])
        elif data["type"] == "list":
            source = list(data["items"])
        else:
            raise CkptError(f"{where}: data source type {data['type']!r}; ckpt writes a TensorDataset or a list")
        gen = None
        if rec["generator"] is not None:
            g = rec["generator"]
            gen = torch.Generator(device=torch.device(g["device"]))
            gen.__setstate__((int(g["seed"]), g["offset"], g["state"]))
        values = {"data_source": source, "replacement": bool(rec["replacement"]),
                  "_num_samples": rec["num_samples"], "generator": gen,
                  "initial_seed": int(rec["initial_seed"]), "epoch": int(rec["epoch"])}  # fmt: skip
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CkptError(f"{where}: not a sampler record ({type(e).__name__}: {e})") from None
    return dump_fields(values)


def dump_fields(values: Mapping[str, Any]) -> bytes:
    """``torch.save`` of a sampler whose ``__dict__`` is ``values`` (:data:`FIELDS`, in that order), pickled as
    ``accelerate.data_loader.SeedableRandomSampler`` without importing accelerate."""
    obj = SamplerState.__new__(SamplerState)
    obj.__dict__.update({k: values[k] for k in FIELDS})
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_module=_pickle_module)
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------------- showing


def _digest(tensors: Any) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def facts(encoded: Any) -> dict[str, Any]:
    """What ``inspect`` and ``diff`` show of a sampler record: plain values, tensors as short sha256 digests."""
    rec = treecodec.decode(encoded)
    data = rec.get("data_source") or {}
    gen = rec.get("generator")
    out = {
        "seed": rec.get("initial_seed"),
        "epoch": rec.get("epoch"),
        "num_samples": rec.get("num_samples"),
        "replacement": rec.get("replacement"),
        "data_source": f"{data.get('type')} of {data.get('length')}",
        "generator": None if gen is None else f"{gen['device']} seed {gen['seed']} state {_digest([gen['state']])}",
    }
    if "tensors" in data:
        out["data_digest"] = _digest(data["tensors"])
    else:
        out["data_digest"] = hashlib.sha256(repr(data.get("items")).encode()).hexdigest()[:16]
    return out


def describe(encoded: Any) -> str:
    """One line: ``SeedableRandomSampler seed 7, epoch 2, ...``."""
    f = facts(encoded)
    n = "all" if f["num_samples"] is None else f["num_samples"]
    gen = f["generator"] or "none yet (first iteration seeds it)"
    return (
        f"SeedableRandomSampler seed {f['seed']}, epoch {f['epoch']}, {n} samples per epoch"
        f"{' with replacement' if f['replacement'] else ''}, data source {f['data_source']}, generator {gen}"
    )


def record_of(extra: Mapping[str, Any] | None) -> Any:
    """The encoded sampler record in a checkpoint's ``extra`` trees, or None."""
    acc = (extra or {}).get("accelerate")
    return acc.get("sampler") if isinstance(acc, Mapping) else None


def differences(a: Any, b: Any) -> list[str]:
    """``sampler <fact>: <a> -> <b>`` for each fact that differs (a record absent on one side says so)."""
    if a is None and b is None:
        return []
    if a is None or b is None:
        return [f"sampler: only in {'A' if b is None else 'B'}"]
    fa, fb = facts(a), facts(b)
    return [f"sampler {k}: {fa[k]} -> {fb[k]}" for k in fa if fa[k] != fb.get(k)]


__all__ = [
    "ALLOWED", "FIELDS", "describe", "differences", "dump_fields", "encode", "facts", "read_sampler", "record_of",
    "sampler_bytes",
]  # fmt: skip
