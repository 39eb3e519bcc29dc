"""ckpt.format.codecs: the chunk checksum (xxh3-64 of the stored bytes), its incremental form, the codec names, and
zstd compression that refuses output of the wrong size."""

from __future__ import annotations

import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.errors import ManifestError
from ckpt.format.codecs import (
    CODECS,
    StreamingChecksum,
    check_checksum_format,
    check_codec,
    checksum,
    compress,
    decompress,
)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=4096))
def test_checksum_is_xxh3_64_of_the_bytes_in_lowercase_hex(data: bytes) -> None:
    value = checksum(data)
    assert value == "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)
    assert checksum(memoryview(data)) == value == checksum(bytearray(data))
    assert check_checksum_format(value) == value


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=2048), cuts=st.lists(st.integers(0, 2048), max_size=6))
def test_streaming_checksum_equals_the_one_shot_checksum_for_any_split(data: bytes, cuts: list[int]) -> None:
    h = StreamingChecksum()
    bounds = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    for a, b in zip(bounds, bounds[1:], strict=False):
        h.update(memoryview(data)[a:b])
    assert h.hexdigest() == checksum(data)


def test_checksum_tells_apart_a_single_flipped_bit() -> None:
    data = bytearray(range(256)) * 4
    flipped = bytearray(data)
    flipped[517] ^= 0x10
    assert checksum(data) != checksum(flipped)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "xxh3_64:",
        "md5:0123456789abcdef",
        "xxh3_64:0123456789abcde",  # 15 digits
        "xxh3_64:0123456789abcdef0",  # 17 digits
        "xxh3_64:0123456789ABCDEF",  # checksum() writes lowercase
        "xxh3_64:0123456789abcdeg",
        "xxh3_64 0123456789abcdef",
    ],
)
def test_checksum_format_refuses_anything_checksum_does_not_write(bad: str) -> None:
    with pytest.raises(ManifestError, match=r"bad checksum .*expected 'xxh3_64:<16 hex digits>'"):
        check_checksum_format(bad)


def test_codec_names() -> None:
    assert CODECS == ("raw", "zstd")
    for c in CODECS:
        assert check_codec(c) == c
    for bad in ("lz4", "ZSTD", "", "gzip"):
        with pytest.raises(ManifestError, match=r"unknown codec .*expected one of raw, zstd"):
            check_codec(bad)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=8192) | st.integers(0, 5000).map(lambda n: bytes(n % 7 for _ in range(n))))
def test_zstd_round_trip(data: bytes) -> None:
    packed = compress(memoryview(data))
    assert decompress(packed, len(data)) == data
    assert zstandard.ZstdDecompressor().decompress(packed) == data  # a plain zstd frame any tool reads


def test_zstd_compresses_redundant_data() -> None:
    data = bytes(64 << 10)
    assert len(compress(data)) < len(data) // 100


@pytest.mark.parametrize("delta", [-1, 1])
def test_decompress_refuses_a_size_other_than_expected(delta: int) -> None:
    data = bytes(range(200)) * 3
    with pytest.raises((ValueError, zstandard.ZstdError)):
        decompress(compress(data), len(data) + delta)
