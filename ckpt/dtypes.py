"""The dtype names written in manifests and data files (safetensors spelling), and the mapping to torch."""

from __future__ import annotations

import torch

from .errors import ManifestError

_TORCH_TO_NAME: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _st in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    _dt = getattr(torch, _name, None)
    if _dt is not None:
        _TORCH_TO_NAME[_dt] = _st

_NAME_TO_TORCH = {v: k for k, v in _TORCH_TO_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _TORCH_TO_NAME[dtype]
    except KeyError:
        raise ManifestError(
            f"dtype {dtype} cannot be stored: supported are {sorted(_NAME_TO_TORCH)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _NAME_TO_TORCH[name]
    except KeyError:
        raise ManifestError(f"unknown dtype {name!r}: expected one of {sorted(_NAME_TO_TORCH)}") from None


def itemsize(name: str) -> int:
    return torch.empty((), dtype=dtype_from_name(name)).element_size()
