"""Lossless, pickle-free JSON encoding of state trees (scheduler, scaler, RNG, data-loader, user state).

State dicts of PyTorch objects hold more than JSON can say: tuples, int keys, non-finite floats, bytes, tensors
and NumPy arrays.  Each of these gets a one-key tagged object (``{"$t": [...]}`` for a tuple and so on, see
docs/format.md), so decoding gives back exactly the values that were saved, and reading a manifest never executes
anything.  Tensors here are inlined (base64): these trees hold counters, RNG states and small buffers, while
model and optimizer tensors go to the data files.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import ManifestError
from .datafile import flat_dense
from .dtypes import dtype_from_name, dtype_name

JSON = Any  # a value made of dict/list/str/int/float/bool/None


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    return flat_dense(t).view(torch.uint8).numpy().tobytes()


def _tensor_from_bytes(raw: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).clone()


def encode(value: Any, path: str = "") -> JSON:
    """Encode ``value`` to JSON-safe data. ``path`` names the position in error messages."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$f": repr(value)}
    if isinstance(value, torch.Tensor):
        return {
            "$tensor": {
                "dtype": dtype_name(value.dtype),
                "shape": list(value.shape),
                "data": base64.b64encode(_tensor_bytes(value)).decode("ascii"),
            }
        }
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)  # note: this makes a 0-d array 1-d, so keep value's own shape
        return {
            "$np": {
                "dtype": arr.dtype.str,
                "shape": list(value.shape),
                "data": base64.b64encode(arr.tobytes()).decode("ascii"),
            }
        }
    if isinstance(value, np.generic):
        return encode(value.item(), path)
    if isinstance(value, (bytes, bytearray)):
        return {"$b": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {"$t": [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, f"{path}.{k}" if path else k) for k, v in value.items()}
        return {"$d": [[encode(k, path), encode(v, f"{path}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    raise ManifestError(
        f"cannot store {type(value).__module__}.{type(value).__qualname__} at {path or '<root>'}: "
        "only JSON values, tuples, tensors and NumPy arrays are stored (give the object a state_dict())"
    )


def decode(data: JSON) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "$f":
            return float(body)
        if tag == "$t":
            return tuple(decode(v) for v in body)
        if tag == "$d":
            return {_hashable(decode(k)): decode(v) for k, v in body}
        if tag == "$b":
            return base64.b64decode(body)
        if tag == "$dtype":
            return dtype_from_name(body)
        if tag == "$tensor":
            return _tensor_from_bytes(
                base64.b64decode(body["data"]), dtype_from_name(body["dtype"]), body["shape"]
            )
        if tag == "$np":
            raw = base64.b64decode(body["data"])
            return np.frombuffer(raw, dtype=np.dtype(body["dtype"])).reshape(body["shape"]).copy()
    return {k: decode(v) for k, v in data.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key
