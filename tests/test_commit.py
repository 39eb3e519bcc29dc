"""ckpt.format.publish: receipts become a manifest only when they cover every described tensor (no gap, no box outside
its tensor, no box twice, no tensor nobody described), and publishing the manifest is create-only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckpt.errors import CheckpointExistsError, ManifestError
from ckpt.format.manifest import MANIFEST_NAME, Layout, Manifest, TensorDesc
from ckpt.format.publish import Receipt, build_manifest, publish
from ckpt.format.reader import read_manifest

CSUM = "xxh3_64:0123456789abcdef"
ENV = {"python": "3", "world_size": 2}


def storage(url: str) -> Any:
    from ckpt.storage import open_storage

    return open_storage(url)


def rows(name: str, start: int, n: int, cols: int, fname: str, off: int) -> tuple:
    """A receipt shard: rows ``start:start+n`` of a float32 (rows x cols) tensor at byte ``off`` of ``fname``."""
    return (name, (start, 0), (n, cols), fname, off, n * cols * 4, "raw", CSUM)


def two_ranks() -> tuple[list[TensorDesc], list[Receipt]]:
    """Tensor 'w' (4x2) split over two ranks, 'b' (3,) on rank 1 only; rank 1 reports its shards out of order."""
    metas = [TensorDesc("w", "parameter", (4, 2), "F32"), TensorDesc("b", "buffer", (3,), "F32")]
    r0 = Receipt(0, [("r00000-a.safetensors", 100)], [rows("w", 0, 2, 2, "r00000-a.safetensors", 64)])
    r1 = Receipt(
        1,
        [("r00001-a.safetensors", 100)],
        [
            ("b", (0,), (3,), "r00001-a.safetensors", 80, 12, "raw", CSUM),
            rows("w", 2, 2, 2, "r00001-a.safetensors", 64),
        ],
    )
    return metas, [r1, r0]


def build(metas: list[TensorDesc], receipts: list[Receipt], **kw: Any) -> Manifest:
    return build_manifest(
        step=5,
        backend="cpu",
        layout=Layout(world_size=2, dp=2),
        metas=metas,
        receipts=receipts,
        trees=kw,
        env=ENV,
    )


def test_receipts_become_a_manifest_with_files_by_rank_and_shards_by_box() -> None:
    metas, receipts = two_ranks()
    m = build(metas, receipts)
    assert {p: (f.size, f.rank) for p, f in m.files.items()} == {
        "r00000-a.safetensors": (100, 0),
        "r00001-a.safetensors": (100, 1),
    }
    w = m.tensors["w"]
    assert (w.role, w.shape, w.dtype) == ("parameter", (4, 2), "F32")
    assert [(s.file, s.box.offsets, s.box.lengths) for s in w.shards] == [
        ("r00000-a.safetensors", (0, 0), (2, 2)),
        ("r00001-a.safetensors", (2, 0), (2, 2)),
    ]
    assert m.tensors["b"].role == "buffer" and m.progress == {"step": 5} and m.environment == ENV
    assert Manifest.from_json(m.to_json()) == m  # what is built is what the reader accepts


def test_per_rank_trees_are_keyed_by_rank_and_shared_trees_copied() -> None:
    metas, receipts = two_ranks()
    m = build_manifest(
        step=5,
        backend="cpu",
        layout=Layout(world_size=2),
        metas=metas,
        receipts=receipts,
        trees={
            "scheduler": {"last_epoch": 5},
            "user": [1],
            "extra": {"k": 1},
            "progress": {"step": 5, "tokens": 9},
        },
        rank_trees={
            1: {"rng": {"torch": 1}, "data": {"pos": 11}},
            0: {"rng": {"torch": 0}, "data": {"pos": 10}},
        },
        env=ENV,
    )
    assert m.rng == {"0": {"torch": 0}, "1": {"torch": 1}} and m.data == {"0": {"pos": 10}, "1": {"pos": 11}}
    assert (m.scheduler, m.user, m.extra, m.progress) == (
        {"last_epoch": 5},
        [1],
        {"k": 1},
        {"step": 5, "tokens": 9},
    )


def test_a_gap_is_refused() -> None:
    metas, receipts = two_ranks()
    with pytest.raises(ManifestError, match=r"^tensor 'w': written shards hold 4 of 8 elements$"):
        build(metas, [r for r in receipts if r.rank == 1])


def test_a_described_tensor_nobody_wrote_is_refused() -> None:
    metas, receipts = two_ranks()
    metas.append(TensorDesc("optim/w/exp_avg", "optimizer_state", (4, 2), "F32", "w", "exp_avg"))
    with pytest.raises(ManifestError, match=r"tensor 'optim/w/exp_avg': written shards hold 0 of 8 elements"):
        build(metas, receipts)


def test_an_empty_tensor_needs_no_shard() -> None:
    m = build([TensorDesc("e", "buffer", (0, 3), "F32")], [])
    assert m.tensors["e"].shards == ()


def test_a_tensor_from_a_receipt_that_no_rank_described_is_refused() -> None:
    metas, receipts = two_ranks()
    receipts[0].shards.append(("ghost", (0,), (1,), "r00001-a.safetensors", 92, 4, "raw", CSUM))
    with pytest.raises(ManifestError, match=r"^rank 1 wrote tensor 'ghost' that no rank described$"):
        build(metas, receipts)


def test_a_box_written_twice_is_refused_even_when_the_count_adds_up() -> None:
    metas, receipts = two_ranks()
    receipts[0].shards[1] = rows("w", 0, 2, 2, "r00001-a.safetensors", 64)  # rank 1 rewrote rank 0's rows
    with pytest.raises(ManifestError, match=r"tensor 'w': box \[0, 0\]\+\[2, 2\] was written twice"):
        build(metas, receipts)


@pytest.mark.parametrize(
    ("offsets", "lengths"),
    [((3, 0), (2, 2)), ((2,), (2,)), ((2, 0, 0), (2, 2, 1)), ((2, 1), (2, 2))],
)
def test_a_box_outside_its_tensor_is_refused(offsets: tuple, lengths: tuple) -> None:
    metas, receipts = two_ranks()
    receipts[0].shards[1] = ("w", offsets, lengths, "r00001-a.safetensors", 64, 16, "raw", CSUM)
    with pytest.raises(
        ManifestError, match=r"rank 1 wrote box .* of tensor 'w', which lies outside its shape \[4, 2\]"
    ):
        build(metas, receipts)


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_publish_is_create_only(kind: str, tmp_path: Path) -> None:
    import uuid

    url = str(tmp_path / "c") if kind == "local" else f"memory://ckpt-commit-test/{uuid.uuid4().hex}"
    st = storage(url)
    metas, receipts = two_ranks()
    first = build(metas, receipts)
    publish(st, first)
    raw = st.read_bytes(MANIFEST_NAME)
    # the same facts, whichever format version publish wrote by default (to_json: the v1 document of them)
    assert read_manifest(st).to_json() == first.to_json()
    second = build(metas, receipts, user={"attempt": 2})
    with pytest.raises(CheckpointExistsError, match="already exists"):
        publish(st, second)
    assert st.read_bytes(MANIFEST_NAME) == raw  # the committed manifest is untouched
    assert json.loads(raw)["user"] is None
