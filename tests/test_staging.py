"""ckpt.saving.staging on the CPU: staged copies equal their sources and stop following them, live as aligned views in
one host arena, and the arena is reused by the next save (grown only when the state grows)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.format.datafile import BUFFER_ALIGN
from ckpt.saving.staging import HostStager

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(
        st.tuples(
            st.sampled_from(DTYPES), st.lists(st.integers(0, 6), max_size=3).map(tuple), st.integers(0, 99)
        ),
        min_size=1,
        max_size=6,
    ),
    transpose=st.booleans(),
)
def test_staged_copies_equal_their_sources(specs: list, transpose: bool) -> None:
    sources = [make(d, s, seed) for d, s, seed in specs]
    if transpose:
        sources = [t.t() if t.dim() == 2 else t for t in sources]  # non-contiguous sources
    stager = HostStager()
    staged = stager.stage(sources)
    assert len(staged) == len(sources)
    for src, out in zip(sources, staged, strict=True):
        assert out.dtype == src.dtype and out.shape == src.shape and out.device.type == "cpu"
        assert out.is_contiguous() and bits(out) == bits(src)


def test_staged_copies_do_not_follow_later_changes_of_the_sources() -> None:
    w = torch.arange(12.0).reshape(3, 4)
    b = torch.ones(5, dtype=torch.int64)
    stager = HostStager()
    sw, sb = stager.stage([w, b])
    w.add_(100.0)  # the training loop goes on
    b.zero_()
    assert torch.equal(sw, torch.arange(12.0).reshape(3, 4)) and torch.equal(
        sb, torch.ones(5, dtype=torch.int64)
    )


def test_views_are_aligned_slices_of_one_arena() -> None:
    stager = HostStager()
    sources = [torch.ones(3, dtype=torch.int8), torch.ones(5), torch.ones(2, 2, dtype=torch.float64)]
    staged = stager.stage(sources)
    base = staged[0].data_ptr()
    offsets = [t.data_ptr() - base for t in staged]
    assert offsets == [0, 64, 128]  # each tensor starts on an ALIGN boundary
    assert all(o % BUFFER_ALIGN == 0 for o in offsets)
    assert stager.nbytes == 3 * BUFFER_ALIGN


def test_arena_is_reused_and_grows_only_with_the_state() -> None:
    stager = HostStager()
    first = stager.stage([torch.full((100,), 1.0)])[0]
    start, end = first.data_ptr(), first.data_ptr() + stager.nbytes
    size = stager.nbytes
    assert size >= 400

    second = stager.stage([torch.full((50,), 2.0), torch.full((10,), 3.0, dtype=torch.float64)])
    assert stager.nbytes == size  # smaller state: same arena
    assert all(start <= t.data_ptr() < end for t in second)
    assert torch.equal(
        first[:50], torch.full((50,), 2.0)
    )  # the previous save's views are overwritten (reused)

    bigger = stager.stage([torch.full((1000,), 4.0)])[0]
    assert stager.nbytes >= 4000 and torch.equal(bigger, torch.full((1000,), 4.0))

    stager.release()
    assert stager.nbytes == 0
    again = stager.stage([torch.full((3,), 5.0)])[0]
    assert torch.equal(again, torch.full((3,), 5.0)) and stager.nbytes > 0


def test_empty_tensors_and_an_empty_list_stage_fine() -> None:
    stager = HostStager()
    out = stager.stage([torch.empty(0, 4), torch.tensor(2.5), torch.empty(0, dtype=torch.bool)])
    assert [tuple(t.shape) for t in out] == [(0, 4), (), (0,)] and out[1].item() == 2.5
    assert stager.stage([]) == []


def test_cpu_staging_does_not_pin_memory() -> None:
    stager = HostStager()
    (t,) = stager.stage([torch.ones(8)])
    assert not t.is_pinned()
