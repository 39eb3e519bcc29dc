"""The dtype names written in manifests and data files (safetensors spelling): their sizes, and torch's dtypes.

Names and sizes are plain data, so that reading and checking a manifest (``ckpt ls``, ``ckpt inspect``) needs no
torch; torch is imported only by the two functions that convert to and from ``torch.dtype``, which run where
tensors are handled anyway.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from ..errors import ManifestError

if TYPE_CHECKING:
    import torch

#: name -> (bytes per element, attribute of the ``torch`` module)
_DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "float64"),
    "F32": (4, "float32"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I64": (8, "int64"),
    "I32": (4, "int32"),
    "I16": (2, "int16"),
    "I8": (1, "int8"),
    "U8": (1, "uint8"),
    "BOOL": (1, "bool"),
    "C64": (8, "complex64"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "U16": (2, "uint16"),
    "U32": (4, "uint32"),
    "U64": (8, "uint64"),
}


def itemsize(name: str) -> int:
    """Bytes per element of the dtype ``name``; ManifestError for a name the format does not have."""
    try:
        return _DTYPES[name][0]
    except KeyError:
        raise ManifestError(f"unknown dtype {name!r}: expected one of {sorted(_DTYPES)}") from None


@cache
def _torch_maps() -> tuple[dict[torch.dtype, str], dict[str, torch.dtype]]:
    import torch

    # an older torch may lack the float8 / unsigned types: those names then cannot be read or written
    to_name = {getattr(torch, attr): name for name, (_, attr) in _DTYPES.items() if hasattr(torch, attr)}
    return to_name, {v: k for k, v in to_name.items()}


def dtype_name(dtype: torch.dtype) -> str:
    to_name, from_name = _torch_maps()
    try:
        return to_name[dtype]
    except KeyError:
        raise ManifestError(f"dtype {dtype} cannot be stored: supported are {sorted(from_name)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    _, from_name = _torch_maps()
    try:
        return from_name[name]
    except KeyError:
        raise ManifestError(f"unknown dtype {name!r}: expected one of {sorted(from_name)}") from None
