"""The ZeRO partition layout (converters/deepspeed_zero.py) as properties: for random parameter shapes, param
groups, world sizes, parameter alignments and stage-3 sub-group sizes, partitioning as DeepSpeed saves and reading
back through the slots gives every parameter exactly; and a layout whose shapes do not add up is refused.  (That the
partition side is DeepSpeed's own is checked against real DeepSpeed folders in test_lightning_deepspeed.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from ckpt.converters.deepspeed_zero import (
    gather,
    partition_zero3,
    partition_zero12,
    zero3_slots,
    zero12_slots,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.errors import LayoutError

shapes = st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3), min_size=1, max_size=6)


def _tensors(shape_list: list[list[int]], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shape_list]


def _zero12(groups: list[list[torch.Tensor]], world: int, align: int) -> tuple:
    saved, padded, paddings = partition_zero12(groups, world, align)
    param_shapes = [{f"g{g}.p{i}": tuple(t.shape) for i, t in enumerate(ts)} for g, ts in enumerate(groups)]
    sizes = [[t.numel() for t in rank] for rank in saved]
    part = [padded[0][g].numel() for g in range(len(groups))]
    return saved, padded, paddings, param_shapes, sizes, part


@settings(max_examples=150, deadline=None)
@given(groups=st.lists(shapes, min_size=1, max_size=3), world=st.integers(1, 5), align=st.sampled_from([1, 2, 4, 8]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_stage_1_2_partitions_read_back_exactly(groups: list, world: int, align: int, seed: int) -> None:
    tensors = [_tensors(g, seed + i) for i, g in enumerate(groups)]
    saved, padded, paddings, param_shapes, sizes, part = _zero12(tensors, world, align)
    for g in range(len(tensors)):
        total = sum(s[g] for s in sizes)
        assert all(padded[r][g].numel() == part[g] for r in range(world))  # equal partitions
        assert part[g] * world == math.ceil(total / (2 * world)) * 2 * world  # padded to 2 * world
    slots = zero12_slots(param_shapes, sizes, part, paddings, "x")
    for g, ts in enumerate(tensors):
        for i, t in enumerate(ts):
            # the saved partitions and the padded ones (the moments' layout) give the same parameter
            assert torch.equal(gather(slots[f"g{g}.p{i}"], lambda r, k: saved[r][k]), t)
            assert torch.equal(gather(slots[f"g{g}.p{i}"], lambda r, k: padded[r][k]), t)


@settings(max_examples=150, deadline=None)
@given(params=shapes, world=st.integers(1, 5), sub_group=st.integers(1, 60), seed=st.integers(0, 2**16))
def test_stage_3_partitions_read_back_exactly(params: list, world: int, sub_group: int, seed: int) -> None:
    tensors = _tensors(params, seed)
    flat = partition_zero3(tensors, world, sub_group)
    assert all(len(f) == len(flat[0]) for f in flat)
    assert sum(t.numel() for t in flat[0]) == sum(math.ceil(t.numel() / world) for t in tensors)
    slots = zero3_slots({f"p{i}": tuple(t.shape) for i, t in enumerate(tensors)},
                        [[t.numel() for t in f] for f in flat], "x")  # fmt: skip
    for i, t in enumerate(tensors):
        assert torch.equal(gather(slots[f"p{i}"], lambda r, k: flat[r][k]), t)


@settings(max_examples=60, deadline=None)
@given(params=shapes, world=st.integers(1, 4), grow=st.sampled_from([-1, 1]), seed=st.integers(0, 2**16))
def test_shapes_that_do_not_add_up_are_refused(params: list, world: int, grow: int, seed: int) -> None:
    tensors = _tensors(params, seed)
    wrong = [list(t.shape) for t in tensors]
    wrong[-1][0] += grow
    if wrong[-1][0] == 0:
        return
    saved, padded, paddings, _, sizes, part = _zero12([tensors], world, 1)
    bad = [{f"p{i}": tuple(s) for i, s in enumerate(wrong)}]
    with pytest.raises(LayoutError, match="param_shapes|partitions"):
        zero12_slots(bad, sizes, part, paddings, "x")
    flat = partition_zero3(tensors, world, 10**9)
    pieces_before = sum(math.ceil(t.numel() / world) for t in tensors)
    pieces_after = pieces_before - math.ceil(tensors[-1].numel() / world) + math.ceil(
        math.prod(wrong[-1]) / world
    )
    if pieces_after != pieces_before:  # a stage-3 change that stays inside the last piece's padding is invisible
        with pytest.raises(LayoutError, match="param_shapes"):
            zero3_slots(bad[0], [[t.numel() for t in f] for f in flat], "x")


def test_a_rank_that_saves_the_wrong_amount_is_refused() -> None:
    tensors = _tensors([[5, 3], [7]], 0)
    saved, padded, paddings, param_shapes, sizes, part = _zero12([tensors], 3, 1)
    sizes[1][0] -= 1
    with pytest.raises(LayoutError, match="rank 1 saves"):
        zero12_slots(param_shapes, sizes, part, paddings, "x")
