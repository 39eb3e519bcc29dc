"""Checksums and compression of stored chunks.

Checksums are computed on the *stored* bytes (after compression) while a chunk is written, so verification on
load needs no decode and a damaged compressed chunk is caught before zstd sees it.  xxh3-64 runs at memory speed,
which keeps "checksums on by default" free next to disk bandwidth.
"""

from __future__ import annotations

import xxhash
import zstandard

from ..errors import ManifestError

CHECKSUM_ALGO = "xxh3_64"
CODECS = ("raw", "zstd")


def checksum(data: bytes | memoryview) -> str:
    """Return ``"xxh3_64:<16 hex digits>"`` for ``data``."""
    return f"{CHECKSUM_ALGO}:{xxhash.xxh3_64_hexdigest(data)}"


class StreamingChecksum:
    """Incremental form of :func:`checksum` for data written in pieces."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return f"{CHECKSUM_ALGO}:{self._h.hexdigest()}"


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise ManifestError(f"unknown codec {codec!r}: expected one of {', '.join(CODECS)}")
    return codec


def check_checksum_format(value: str) -> str:
    """``value`` is ``"xxh3_64:"`` and 16 lowercase hex digits, as :func:`checksum` writes it."""
    algo, _, digest = value.partition(":")
    if algo != CHECKSUM_ALGO or len(digest) != 16 or any(c not in "0123456789abcdef" for c in digest):
        raise ManifestError(f"bad checksum {value!r}: expected '{CHECKSUM_ALGO}:<16 hex digits>'")
    return value


def compress(data: bytes | memoryview, level: int = 3) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data)


def decompress(data: bytes | memoryview, expected_size: int) -> bytes:
    out = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected_size)
    if len(out) != expected_size:
        raise ValueError(f"decompressed {len(out)} bytes, expected {expected_size}")
    return out
