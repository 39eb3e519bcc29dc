"""Writing a safetensors data file from byte buffers, hashing each block in the same pass as its write.

Torch-free on purpose: the persistent writer process (:mod:`ckpt.saving.writer_child`) imports only this, the
checksums and the local storage, so it starts in a fraction of a second and holds no torch memory.  Data files
(:mod:`ckpt.format.datafile`) and HF shards use the same header writer, so every writer produces the same bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import BinaryIO

from .codecs import StreamingChecksum

# hashed then written block by block: the hash reads the block from memory, the write() finds it still in the
# CPU cache, so a byte is read from memory once for both (was: a hash pass over the whole chunk, then the write)
HASH_WRITE_BLOCK = 4 << 20


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


def write_all(f: BinaryIO, data: memoryview | bytes) -> None:
    """``f.write`` until every byte of ``data`` is written (a raw file may write less than asked)."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        n = f.write(view[done:])
        done += len(view) - done if n is None else n


def write_payloads(
    f: BinaryIO, head: bytes, payloads: Sequence[memoryview | bytes]
) -> tuple[list[tuple[int, int, str]], int]:
    """Write ``head`` then every payload back to back; return ``(offset, nbytes, checksum)`` of each payload and
    the file size.  Each payload is hashed block by block right before the block is written (one read of memory)."""
    write_all(f, head)
    out: list[tuple[int, int, str]] = []
    offset = len(head)
    for p in payloads:
        view = memoryview(p).cast("B") if not isinstance(p, bytes) else memoryview(p)
        h = StreamingChecksum()
        for start in range(0, len(view), HASH_WRITE_BLOCK):
            block = view[start : start + HASH_WRITE_BLOCK]
            h.update(block)
            write_all(f, block)
        out.append((offset, len(view), h.hexdigest()))
        offset += len(view)
    return out, offset
