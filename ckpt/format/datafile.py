"""Data files: valid safetensors files written per rank, one entry per stored chunk.

Any safetensors reader can open an uncompressed data file; zstd-compressed chunks are stored as ``U8`` entries
(their codec, dtype and shape are in the manifest).  The file is streamed: header first (sizes are known after
compression), then each chunk, checksummed on the exact bytes written.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

import torch

from .codecs import checksum, compress
from .dtypes import dtype_name

WRITE_BLOCK = 1 << 30

#: Where a tensor's bytes may start in a host buffer that holds several tensors (the staging arena of async saves,
#: the upload arena of restores, the NxD converter's scratch slabs): a multiple of 64 bytes, a cache line, which is
#: more than any dtype needs, so every view of such a buffer is aligned for its dtype and for vectorised copies.
BUFFER_ALIGN = 64


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`BUFFER_ALIGN` (where the next tensor in a host buffer may start)."""
    return (n + BUFFER_ALIGN - 1) // BUFFER_ALIGN * BUFFER_ALIGN


@dataclass(frozen=True)
class Chunk:
    """One piece of one tensor to store; ``tensor`` is on the host and contiguous."""

    key: str
    tensor: torch.Tensor
    codec: str = "raw"


@dataclass(frozen=True)
class Written:
    key: str
    offset: int
    nbytes: int
    checksum: str


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous host tensor, without copying."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(flat_dense(t).view(torch.uint8).numpy())


def flat_dense(t: torch.Tensor) -> torch.Tensor:
    """A 1-d, stride-1 view of a contiguous tensor.

    ``reshape(-1)`` is not enough: a contiguous tensor with size-1 dims can keep any stride on them (a row of a
    transposed matrix: shape (1, 1), stride (1, 2)) and its flat view then has stride 2, which cannot be viewed as
    bytes.  ``is_contiguous()`` guarantees the elements are dense, so a stride-1 view over them is exact.
    """
    if not t.is_contiguous():
        raise ValueError(f"expected a contiguous tensor, got shape {list(t.shape)} stride {list(t.stride())}")
    return t.as_strided((t.numel(),), (1,))


def safetensors_header(
    entries: Sequence[tuple[str, str, Sequence[int], int]], metadata: dict[str, str] | None = None
) -> bytes:
    """The 8-byte length + JSON header of a safetensors file whose payloads follow back to back, in order.

    ``entries`` are ``(key, dtype name, shape, payload bytes)``; the header is padded with spaces to a multiple of 8
    (as safetensors writes it) so the data that follows is aligned.  The one header writer: data files and HF shards.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata or {})} if metadata is not None else {}
    pos = 0
    for key, dtype, shape, nbytes in entries:
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_shard_file(
    f: BinaryIO, chunks: Sequence[Chunk], metadata: dict[str, str] | None = None, threads: int = 4
) -> tuple[list[Written], int]:
    """Write ``chunks`` to ``f`` as a safetensors file; return where each chunk landed and the file size."""
    payloads: list[memoryview | bytes] = [tensor_bytes(c.tensor) for c in chunks]
    to_compress = [i for i, c in enumerate(chunks) if c.codec == "zstd"]
    if to_compress:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for i, data in zip(
                to_compress, pool.map(lambda i: compress(payloads[i]), to_compress), strict=True
            ):
                payloads[i] = data
    entries = []
    for c, p in zip(chunks, payloads, strict=True):
        if c.codec == "raw":
            entries.append((c.key, dtype_name(c.tensor.dtype), tuple(c.tensor.shape), len(p)))
        else:
            entries.append((c.key, "U8", (len(p),), len(p)))
    head = safetensors_header(entries, {"format": "ckpt", **(metadata or {})})
    f.write(head)
    written = []
    offset = len(head)
    for c, p in zip(chunks, payloads, strict=True):
        digest = checksum(p)
        view = memoryview(p)
        done = 0
        while done < len(view):
            done += f.write(view[done : done + WRITE_BLOCK])
        written.append(Written(c.key, offset, len(p), digest))
        offset += len(p)
    return written, offset
