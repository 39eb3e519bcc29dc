"""Local writer planning (ckpt.saving.planning.plan_local): every distinct box gets exactly one writer, computed by each
rank from its own pieces and replica groups, and the all-reduced check catches ranks that disagree.

All ranks of a job are simulated in the test process (pure functions, no I/O); tests/test_core_scale_ranks.py
runs the same planning on 16 real gloo ranks.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.format.manifest import Box, TensorDesc
from ckpt.saving.planning import Group, HeldBox, mesh_group, plan_check, plan_local, world_group


def split(length: int, parts: int, index: int) -> tuple[int, int]:
    size = -(-length // parts)
    start = min(size * index, length)
    return start, max(0, min(size, length - start))


def coords(shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


def dtensor_pieces(
    descs: list[TensorDesc], mesh: tuple[int, ...], shard: tuple[bool, ...], rank: int
) -> tuple[list[HeldBox], list[Group]]:
    """Pieces of a DTensor state with placements Shard(0) on the mesh dims flagged in ``shard`` (nested, in mesh
    order, as DTensor does) and Replicate on the others."""
    c = coords(mesh, rank)
    pieces, groups = [], []
    for d in descs:
        off, n = 0, d.shape[0]
        for size, sh, ci in zip(mesh, shard, c, strict=True):
            if sh:
                o, n = split(n, size, ci)
                off += o
        pieces.append(HeldBox(d, Box((off, *([0] * (len(d.shape) - 1))), (n, *d.shape[1:]))))
        groups.append(mesh_group(7, mesh, [not s for s in shard], c))
    return pieces, groups


def check_job(
    per_rank: list[tuple[list[HeldBox], list[Group]]],
) -> tuple[bool, dict[tuple[str, Box], list[int]]]:
    writers: dict[tuple[str, Box], list[int]] = {}
    a = b = 0
    for rank, (pieces, groups) in enumerate(per_rank):
        write, (x, y) = plan_local(pieces, groups)
        a, b = a + x, b + y
        for p, w in zip(pieces, write, strict=True):
            writers.setdefault((p.name, p.box), [])
            if w:
                writers[(p.name, p.box)].append(rank)
    return plan_check((a, b)), writers


DESCS = [
    TensorDesc(f"t{i}", "parameter", (rows, 3), "F32") for i, rows in enumerate((1, 2, 5, 8, 13, 64, 7, 0))
]


@settings(max_examples=60, deadline=None)
@given(
    mesh=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
    data=st.data(),
)
def test_every_box_has_exactly_one_writer_and_the_check_passes(
    mesh: tuple[int, ...], data: st.DataObject
) -> None:
    shard = tuple(data.draw(st.lists(st.booleans(), min_size=len(mesh), max_size=len(mesh))))
    world = math.prod(mesh)
    job = [dtensor_pieces(DESCS, mesh, shard, r) for r in range(world)]
    ok, writers = check_job(job)
    assert ok
    # empty boxes of different shard coordinates coincide (offset 0, no rows): each group writes its own, which the
    # commit accepts (no bytes); every other box has exactly one writer
    bad = {k: v for k, v in writers.items() if len(v) != 1 and not (k[1].numel == 0 and v)}
    assert not bad


def test_replicated_state_is_spread_over_the_ranks() -> None:
    descs = [TensorDesc(f"w{i}", "parameter", (16, 4), "F32") for i in range(64)]
    world = 8
    job = [
        ([HeldBox(d, Box.full(d.shape)) for d in descs], [world_group(r, world)] * len(descs))
        for r in range(world)
    ]
    ok, writers = check_job(job)
    assert ok
    counts = [sum(1 for w in writers.values() if w == [r]) for r in range(world)]
    assert counts == [8] * world


def test_a_replica_with_another_shape_fails_the_check() -> None:
    world = 4
    job = [
        ([HeldBox(d, Box.full(d.shape)) for d in DESCS], [world_group(r, world)] * len(DESCS))
        for r in range(world)
    ]
    odd = TensorDesc("t3", "parameter", (9, 3), "F32")
    pieces, groups = job[2]
    job[2] = ([HeldBox(odd, Box.full(odd.shape)) if p.name == "t3" else p for p in pieces], groups)
    assert not check_job(job)[0]


def test_a_replica_holding_an_extra_tensor_fails_the_check() -> None:
    world = 4
    job = [
        ([HeldBox(d, Box.full(d.shape)) for d in DESCS], [world_group(r, world)] * len(DESCS))
        for r in range(world)
    ]
    extra = TensorDesc("only_on_rank_1", "buffer", (2,), "F32")
    pieces, groups = job[1]
    job[1] = ([*pieces, HeldBox(extra, Box.full(extra.shape))], [*groups, world_group(1, world)])
    assert not check_job(job)[0]


def test_sharded_ranks_disagreeing_on_a_global_shape_fail_the_check() -> None:
    # FSDP: every group has one member, so only the tiling terms can notice
    world = 4
    job = [dtensor_pieces(DESCS, (world,), (True,), r) for r in range(world)]
    assert check_job(job)[0]
    bad = [
        TensorDesc(d.name, d.role, (d.shape[0] + 4, 3) if d.name == "t5" else d.shape, d.dtype) for d in DESCS
    ]
    job[3] = dtensor_pieces(bad, (world,), (True,), 3)
    assert not check_job(job)[0]


def test_a_group_index_outside_its_size_is_refused() -> None:
    d = DESCS[0]
    try:
        plan_local([HeldBox(d, Box.full(d.shape))], [Group(("g",), 2, 2)])
    except ValueError as e:
        assert "'t0'" in str(e)
    else:
        raise AssertionError("accepted index 2 of a group of 2")
