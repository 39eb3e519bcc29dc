"""ckpt.format.datafile: data files are valid safetensors files (any safetensors reader opens them), each chunk lands
where ``write_shard_file`` says with the checksum of its stored bytes, and zstd chunks are U8 entries that
decompress to the tensor's bytes."""

from __future__ import annotations

import io
import json
import math
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from ckpt.format.codecs import checksum, decompress
from ckpt.format.datafile import Chunk, flat_dense, tensor_bytes, write_shard_file

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (0/1 for bool)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def header(raw: bytes) -> tuple[int, dict]:
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


chunk_specs = st.lists(
    st.tuples(
        st.sampled_from(DTYPES),
        st.lists(st.integers(0, 5), max_size=3).map(tuple),
        st.integers(0, 2**31),
        st.sampled_from(["raw", "zstd"]),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=chunk_specs)
def test_data_file_is_safetensors_and_each_chunk_is_where_and_what_it_says(specs: list) -> None:
    chunks = [Chunk(f"t{i}@0", make(d, s, seed), codec) for i, (d, s, seed, codec) in enumerate(specs)]
    buf = io.BytesIO()
    written, size = write_shard_file(buf, chunks, {"step": "3", "rank": "1"})
    raw = buf.getvalue()
    assert size == len(raw)
    n, head = header(raw)
    assert n % 8 == 0 and head["__metadata__"] == {"format": "ckpt", "step": "3", "rank": "1"}
    assert [w.key for w in written] == [c.key for c in chunks]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r00000-x.safetensors"
        path.write_bytes(raw)
        with safe_open(str(path), framework="pt") as f:
            assert sorted(f.keys()) == sorted(c.key for c in chunks)
            assert f.metadata() == head["__metadata__"]
            for c, w in zip(chunks, written, strict=True):
                stored = raw[w.offset : w.offset + w.nbytes]
                assert w.checksum == checksum(stored)
                assert head[c.key]["data_offsets"] == [w.offset - 8 - n, w.offset - 8 - n + w.nbytes]
                got = f.get_tensor(c.key)
                if c.codec == "raw":
                    assert got.dtype == c.tensor.dtype and tuple(got.shape) == tuple(c.tensor.shape)
                    assert bits(got) == bits(c.tensor) == stored
                else:
                    assert got.dtype == torch.uint8 and tuple(got.shape) == (w.nbytes,)
                    assert bits(got) == stored
                    assert decompress(stored, len(bits(c.tensor))) == bits(c.tensor)


def test_chunks_are_contiguous_after_the_header_in_order() -> None:
    chunks = [Chunk(f"c{i}", torch.full((i + 1,), float(i))) for i in range(4)]
    buf = io.BytesIO()
    written, size = write_shard_file(buf, chunks)
    n, _ = header(buf.getvalue())
    ends = [8 + n] + [w.offset + w.nbytes for w in written]
    assert [w.offset for w in written] == ends[:-1] and ends[-1] == size


def test_empty_file_is_still_a_valid_safetensors_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    with open(path, "wb") as f:
        written, size = write_shard_file(f, [])
    assert written == [] and size == path.stat().st_size
    with safe_open(str(path), framework="pt") as f:
        assert list(f.keys()) == [] and f.metadata() == {"format": "ckpt"}


def test_zstd_shrinks_a_redundant_chunk() -> None:
    t = torch.zeros(1024, dtype=torch.float32)
    buf = io.BytesIO()
    (w,), _ = write_shard_file(buf, [Chunk("z@0", t, "zstd")])
    assert w.nbytes < 100


def test_contiguous_tensor_with_odd_strides_on_size_one_dims_is_written_as_is() -> None:
    """``is_contiguous()`` ignores the strides of size-1 dims: such tensors are dense and written without a copy."""
    odd = torch.arange(6.0).reshape(3, 2).t()[0:1, 0:1]  # an element of a transposed matrix
    assert odd.is_contiguous() and odd.stride() == (1, 2) and odd.reshape(-1).stride() == (2,)
    wide = torch.arange(8.0).as_strided((1, 3, 1), (7, 1, 5), 2)
    assert wide.is_contiguous()
    for t, values in ((odd, [0.0]), (wide, [2.0, 3.0, 4.0])):
        assert flat_dense(t).stride() == (1,) and flat_dense(t).tolist() == values
        assert bytes(tensor_bytes(t)) == torch.tensor(values).numpy().tobytes()
        buf = io.BytesIO()
        (w,), _ = write_shard_file(buf, [Chunk("t@0", t)])
        assert buf.getvalue()[w.offset : w.offset + w.nbytes] == torch.tensor(values).numpy().tobytes()


def test_a_non_contiguous_tensor_is_refused() -> None:
    t = torch.arange(6.0).reshape(2, 3).t()
    with pytest.raises(ValueError, match="expected a contiguous tensor"):
        tensor_bytes(t)
    with pytest.raises(ValueError, match="expected a contiguous tensor"):
        write_shard_file(io.BytesIO(), [Chunk("t@0", t)])
