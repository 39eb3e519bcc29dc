"""Rank 0's check of a format-2 commit on arrays (ckpt.format.tiling.tile) gives exactly what the per-box path
(tile_one_by_one, the algorithm before it) gives: the same ``pieces`` of every tensor, or the same one-line error
naming the same first bad box, for regular, nested, irregular and broken layouts of boxes over ranks."""

from __future__ import annotations

import json
import pickle
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt.errors import ManifestError
from ckpt.format.placement import split
from ckpt.format.publish import RankSummary, manifest_from_summaries
from ckpt.format.schema import Layout, TensorDesc
from ckpt.format.tiling import PackedBoxes, tile, tile_one_by_one

Piece = tuple[str, tuple[int, ...], tuple[int, ...]]


def outcome(fn, by_name, written):  # type: ignore[no-untyped-def]
    try:
        return "ok", json.dumps(fn(by_name, written))  # JSON: no numpy integer may leak into the manifest
    except ManifestError as e:
        return "error", str(e)


def nested(
    shape: tuple[int, ...], levels: list[tuple[int, int]]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every block of a nested split, in block order (empty blocks included)."""
    out = [((0,) * len(shape), shape)]
    for d, parts in levels:
        nxt = []
        for offs, lens in out:
            for i in range(parts):
                o, n = split(lens[d], parts, i)
                nxt.append((offs[:d] + (offs[d] + o,) + offs[d + 1 :], lens[:d] + (n,) + lens[d + 1 :]))
        out = nxt
    return out


@st.composite
def layouts(draw: st.DrawFn) -> tuple[dict[str, TensorDesc], list[tuple[int, list[Piece]]]]:
    world = draw(st.integers(1, 9))
    n_t = draw(st.integers(1, 4))
    by_name: dict[str, TensorDesc] = {}
    per_rank: dict[int, list[Piece]] = {r: [] for r in range(world)}
    for t in range(n_t):
        shape = tuple(draw(st.lists(st.integers(0, 12), max_size=3)))
        name = f"model.layers.{t}.w"
        by_name[name] = TensorDesc(name, "parameter", shape, "F32")
        kind = draw(st.sampled_from(["whole", "split", "split", "nested", "cuts"] if shape else ["whole"]))
        if kind == "whole":
            blocks = [((0,) * len(shape), shape)]
        elif (
            kind == "split"
        ):  # FSDP / TP / ZeRO-1: dim d over `parts` (empty blocks kept, as DTensor ranks do)
            d = draw(st.integers(0, len(shape) - 1))
            blocks = nested(shape, [(d, draw(st.integers(1, world + 2)))])
        elif kind == "nested":  # HSDP-like or 2-D: two levels, on one dim or on two
            d1, d2 = (draw(st.integers(0, len(shape) - 1)) for _ in range(2))
            blocks = nested(shape, [(d1, draw(st.integers(1, 4))), (d2, draw(st.integers(1, 4)))])
        else:  # an irregular tiling of dim 0
            cuts = sorted(set(draw(st.lists(st.integers(0, shape[0]), max_size=4))) | {0, shape[0]})
            blocks = [
                ((a, *(0,) * (len(shape) - 1)), (b - a, *shape[1:]))
                for a, b in zip(cuts, cuts[1:], strict=False)
            ]
        how = draw(st.sampled_from(["affine", "reversed", "random"]))
        start, step = draw(st.integers(0, world - 1)), draw(st.integers(0, 2))
        for i, (offs, lens) in enumerate(blocks):
            if how == "affine":
                r = (start + i * step) % world
            elif how == "reversed":
                r = (world - 1 - i) % world
            else:
                r = draw(st.integers(0, world - 1))
            per_rank[r].append((name, offs, lens))
    written = [(r, p) for r, p in per_rank.items()]
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    for _, p in written:
        if draw(st.booleans()):
            rnd.shuffle(p)  # the order a rank lists its boxes in
    broken = draw(st.sampled_from([None] * 6 + ["gap", "twice", "outside", "unknown", "dims", "negative"]))
    boxes = [(r, i) for r, p in written for i in range(len(p))]
    if broken and boxes:
        r, i = rnd.choice(boxes)
        name, offs, lens = written[r][1][i]
        if broken == "gap":
            del written[r][1][i]
        elif broken == "twice":
            written[rnd.randrange(world)][1].append((name, offs, lens))
        elif broken == "outside" and lens:
            written[r][1][i] = (name, offs, (lens[0] + 1, *lens[1:]))
        elif broken == "unknown":
            written[r][1][i] = ("nobody.described.me", offs, lens)
        elif broken == "dims":
            written[r][1][i] = (name, (*offs, 0), (*lens, 1))
        elif broken == "negative" and offs:
            written[r][1][i] = (name, (-1, *offs[1:]), (lens[0] + 1, *lens[1:]))
    if draw(st.booleans()):
        rnd.shuffle(written)  # summaries arrive in any order
    return by_name, written


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_arrays_and_one_by_one_agree(
    case: tuple[dict[str, TensorDesc], list[tuple[int, list[Piece]]]],
) -> None:
    by_name, written = case
    packed = [(r, pickle.loads(pickle.dumps(PackedBoxes(p)))) for r, p in written]  # as rank 0 receives them
    assert [list(p) for _, p in packed] == [p for _, p in written]
    assert outcome(tile, by_name, packed) == outcome(tile_one_by_one, by_name, written)


def fsdp_tp_zero1(world: int, n_t: int) -> tuple[list[TensorDesc], list[RankSummary]]:
    """Realistic layouts at once: FSDP Shard(0) with a world that does not divide the rows (empty boxes on the last
    ranks), TP 4 over one dim with DP replicas writing in turn (a rank list, not affine), whole norms written by
    rank 0, a scalar, an empty tensor."""
    descs, per_rank = [], {r: [] for r in range(world)}
    for t in range(n_t):
        name = f"layers.{t}.w"
        if t % 4 == 0:
            shape: tuple[int, ...] = (world * 3 - 2, 5)
            for r in range(world):
                o, n = split(shape[0], world, r)
                per_rank[r].append((name, (o, 0), (n, 5)))
        elif t % 4 == 1:
            shape = (6, 8)
            for i in range(4):
                o, n = split(8, 4, i)
                per_rank[(i * 3 + t) % world].append((name, (0, o), (6, n)))
        elif t % 4 == 2:
            shape = (7,)
            per_rank[0].append((name, (0,), (7,)))
        else:
            shape = () if t % 8 == 3 else (0, 3)
            per_rank[t % world].append((name, (0,) * len(shape), shape))
        descs.append(TensorDesc(name, "parameter", shape, "F32"))
    return descs, [
        RankSummary(r, [(f"r{r:05d}.safetensors", 10)], PackedBoxes(p)) for r, p in per_rank.items()
    ]


@pytest.mark.parametrize("world", [1, 7, 64])
def test_the_commit_describes_real_layouts_as_the_per_box_path_does(world: int) -> None:
    descs, summaries = fsdp_tp_zero1(world, 24)
    received = pickle.loads(pickle.dumps(summaries))
    m, written = manifest_from_summaries(
        step=1,
        backend="cpu",
        layout=Layout(world_size=world),
        metas=descs,
        summaries=received,
        trees={},
        env={},
    )
    by_name = {d.name: d for d in descs}
    assert written.pieces == tile_one_by_one(by_name, [(s.rank, list(s.pieces)) for s in summaries])
    assert written.pieces["layers.0.w"]["ranks"] == {"start": 0, "steps": [1]} or world == 1
    assert len(m.files) == world


def test_a_box_written_twice_is_named_as_before() -> None:
    descs, summaries = fsdp_tp_zero1(8, 4)
    summaries[5].pieces.append(("layers.0.w", (0, 0), (3, 5)))  # rank 0's box of an FSDP tensor, again
    with pytest.raises(ManifestError, match=r"tensor 'layers.0.w': box \[0, 0\]\+\[3, 5\] was written twice"):
        manifest_from_summaries(
            step=1,
            backend="cpu",
            layout=Layout(world_size=8),
            metas=descs,
            summaries=summaries,
            trees={},
            env={},
        )
