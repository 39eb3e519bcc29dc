"""Facts taken when a checkpoint is saved, so that a resume with no step logged twice can still be judged.

Why: a crash right after checkpoint N leaves no overlapping steps, and two defects then leave no trace in the
logged values: a restore that did not apply the checkpoint's RNG state (the run draws other numbers, at the same
loss level), and a checkpoint N that holds the weights of another step (an async save that copied too early: the
run continues smoothly from a slightly older model).  Two cheap facts decide them:

* :func:`rng_digests`: a digest per RNG stream (Python, NumPy, torch CPU, each CUDA device, the XLA seed), taken
  when the checkpoint captures the RNG (the state it holds) and again right after the restore applied it; equal
  streams mean the restore put the saved state back.  Per stream, so that a stream one side could not see (CUDA
  not yet initialised in a fresh process) is left out rather than read as a difference;
* :func:`weights_sample`: a fingerprint of the live weights taken on the training thread when the save is
  requested (before any async staging): :data:`SAMPLE` elements per tensor at fixed positions, hashed with the
  tensor's name, dtype and shape.  O(#tensors) small gathers, whatever the model's size.  At verify time the same
  elements are read from the restored checkpoint (:func:`manifest_sample` for ours, :func:`safetensors_sample` for
  a Trainer ``checkpoint-N``); a tensor whose sample differs proves the checkpoint does not hold the weights the
  run had at step N.  Tensors whose dtype or shape differ between the two sides (another layout, a sharded
  parameter) are not compared.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SAMPLE = 32
"""Elements sampled per tensor: the centres of ``SAMPLE`` equal stretches of its flattened elements (every element
of a smaller tensor)."""

Fingerprint = dict[str, str]
"""tensor name -> ``"F32[128, 8]:<16 hex>"``: dtype and shape, then the hash of the sampled elements."""


def rng_digests() -> dict[str, str]:
    """A 16-hex digest per RNG stream of this process: ``python``, ``numpy``, ``torch``, ``cuda:<i>`` (only when
    CUDA is already initialised: calling this never initialises it) and ``xla`` (when torch_xla is imported)."""
    import random

    import numpy as np

    def h(*parts: bytes) -> str:
        d = hashlib.blake2b(digest_size=8)
        for p in parts:
            d.update(p)
        return d.hexdigest()

    out = {"python": h(repr(random.getstate()).encode())}
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy"] = h(
        np.asarray(keys).tobytes(), repr((name, int(pos), int(has_gauss), float(cached))).encode()
    )
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = h(torch.get_rng_state().numpy().tobytes())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, state in enumerate(torch.cuda.get_rng_state_all()):
                out[f"cuda:{i}"] = h(state.numpy().tobytes())
    if "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        out["xla"] = h(repr(xm.get_rng_state()).encode())
    return out


def positions(numel: int, k: int = SAMPLE) -> list[int]:
    """The flat indices sampled from a tensor of ``numel`` elements (fixed: the same on both sides)."""
    if numel <= k:
        return list(range(numel))
    return [(2 * j + 1) * numel // (2 * k) for j in range(k)]


def _entry(name: str, dtype: str, shape: Iterable[int], values: Any) -> str:
    """The fingerprint string of one tensor from its sampled ``values`` (a 1-D CPU tensor in its own dtype)."""
    import torch

    shape = [int(d) for d in shape]
    raw = values.contiguous().view(torch.uint8).numpy().tobytes() if values.numel() else b""
    d = hashlib.blake2b(digest_size=8)
    d.update(f"{name}|{dtype}|{shape}|".encode())
    d.update(raw)
    return f"{dtype}{shape}:{d.hexdigest()}"


def tensor_sample(name: str, t: Any) -> str | None:
    """The fingerprint of one live tensor, or None for one this process does not hold whole (a DTensor shard) or
    that lives on an XLA device: there each tensor's gather would be a graph of its own to compile and run at every
    save, and verify-resume does not compare Neuron layouts' samples anyway."""
    import torch
    from torch.distributed.tensor import DTensor

    from ckpt.format.dtypes import dtype_name

    if isinstance(t, DTensor) or not isinstance(t, torch.Tensor) or t.device.type == "xla":
        return None
    t = t.detach()
    n = t.numel()
    # positions() in int64 arithmetic: no Python list per tensor
    k = torch.arange(min(n, SAMPLE), dtype=torch.long)
    idx = (k if n <= SAMPLE else (2 * k + 1) * n // (2 * SAMPLE)).to(t.device)
    if t.dim() == 0:
        values = t.reshape(1)
    elif t.is_contiguous():
        values = t.view(-1)[idx]
    else:
        values = t[torch.unravel_index(idx, tuple(t.shape))]
    return _entry(name, dtype_name(t.dtype), t.shape, values.cpu())


def weights_sample(model: Any) -> Fingerprint | None:
    """The fingerprint of a live model's parameters and buffers (``nn.Module`` or flat state dict, the names a save
    stores them under), None when there is nothing to fingerprint.  Take it on the training thread when the save is
    requested."""
    import torch

    from ckpt.errors import StateMismatchError
    from ckpt.state.training import model_tensors

    if isinstance(model, torch.nn.Module):
        # named_parameters/named_buffers, not state_dict(): this runs on rank 0 only, and a module's state_dict
        # can be a collective (FSDP1's full state dict gathers over every rank: rank 0 alone would wait forever).
        # Names a wrapper stores differently (FSDP1's flat parameters) then match nothing and are not compared.
        named = [*model.named_parameters(), *model.named_buffers()]
    else:
        try:
            named = [(nt.name, nt.tensor) for nt in model_tensors(model)]
        except StateMismatchError:
            return None
    out: Fingerprint = {}
    for name, tensor in named:
        try:
            fp = tensor_sample(name, tensor)
        except (RuntimeError, ValueError, TypeError, NotImplementedError):
            fp = None  # a tensor that cannot be read here (a meta or fake tensor): left out, never guessed
        if fp is not None:
            out[name] = fp
    return out or None


def take(model: Any, *, rng: bool) -> tuple[dict[str, Any], float]:
    """A save event's facts, taken on the training thread when the save is requested: ``rng_digests`` (when the
    checkpoint captures the RNG) and ``weights_sample`` (of ``model``, when there is one to fingerprint), with the
    seconds they cost.  One place for :class:`ckpt.CheckpointManager` and the Trainer callback."""
    import time

    t0 = time.perf_counter()
    facts: dict[str, Any] = {}
    if rng:
        facts["rng_digests"] = rng_digests()
    if model is not None:
        sample = weights_sample(model)
        if sample is not None:
            facts["weights_sample"] = sample
    return facts, time.perf_counter() - t0


def _stored(name: str, dtype: str, shape: tuple[int, ...], rows: Any) -> str:
    """The fingerprint of a stored tensor whose rows ``rows(lo, hi)`` (a tensor of rows lo..hi-1) can be read."""
    import torch

    numel = 1
    for d in shape:
        numel *= d
    pos = positions(numel)
    if not shape:
        return _entry(name, dtype, shape, rows(0, 1).reshape(1))
    per_row = numel // shape[0] if shape[0] else 0
    vals = []
    cache: dict[int, Any] = {}
    for p in pos:
        r = p // per_row
        if r not in cache:
            cache[r] = rows(r, r + 1).reshape(-1)
        vals.append(cache[r][p % per_row])
    dt = vals[0].dtype if vals else torch.float32
    return _entry(name, dtype, shape, torch.stack(vals) if vals else torch.empty(0, dtype=dt))


def manifest_sample(path: str, storage_options: dict[str, Any] | None = None) -> Fingerprint | None:
    """The fingerprint of a checkpoint of ours, read from its model tensors (one whole tensor in memory at a time),
    or None when it stores another view than the model's state_dict (a Neuron layout: names and head order of its
    own), so that nothing is compared."""
    from ckpt.converters.digest import HF_VIEW, MODEL_ROLES, manifest_view
    from ckpt.format.reader import CheckpointReader

    reader = CheckpointReader(path, storage_options)
    if manifest_view(reader.manifest) != HF_VIEW:
        return None
    out: Fingerprint = {}
    for name, e in reader.manifest.tensors.items():
        if e.role not in MODEL_ROLES:
            continue
        t = reader.read(name)
        out[name] = _stored(name, e.dtype, tuple(e.shape), lambda lo, hi, t=t: t[lo:hi] if t.dim() else t)
    return out


def safetensors_sample(folder: str | os.PathLike[str]) -> Fingerprint | None:
    """The fingerprint of the ``*.safetensors`` weights of a folder (a Trainer ``checkpoint-N``), reading only the
    rows that hold sampled elements; None when the folder has none."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    out: Fingerprint = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a Mapping
                sl = fh.get_slice(name)
                shape = tuple(int(d) for d in sl.get_shape())
                if not shape:
                    out[name] = _stored(
                        name, sl.get_dtype(), shape, lambda lo, hi, n=name, h=fh: h.get_tensor(n)
                    )
                    continue
                out[name] = _stored(name, sl.get_dtype(), shape, lambda lo, hi, s=sl: s[lo:hi])
    return out


def compare_samples(saved: Mapping[str, str], stored: Mapping[str, str]) -> tuple[int, list[str]]:
    """(tensors compared, names whose samples differ): only names both hold in the same dtype and shape."""
    common = [n for n, v in saved.items() if n in stored and stored[n].split(":")[0] == v.split(":")[0]]
    return len(common), [n for n in common if saved[n] != stored[n]]
