"""The saver's format 2 commit (ckpt.format.publish: write_rank_files, manifest_from_summaries, publish): writers
seal their own index and state file, rank 0 checks boxes.

Real files on local storage, two simulated writer ranks; the result is read back with the ordinary reading API and
compared with what the v1 commit of the same receipts gives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from manifest_schema import assert_valid

from ckpt.errors import ManifestError
from ckpt.format.manifest import MANIFEST_NAME, Box, Layout, TensorDesc
from ckpt.format.publish import (
    Receipt,
    build_manifest,
    data_file_name,
    manifest_from_summaries,
    publish,
    write_data_file,
    write_rank_files,
)
from ckpt.format.reader import CheckpointReader, read_manifest
from ckpt.saving.planning import chunk_boxes
from ckpt.storage import open_storage

SHAPE = (6, 4)
DESCS = [TensorDesc("w", "parameter", SHAPE, "F32"), TensorDesc("b", "parameter", (4,), "F32")]
FULL = {"w": torch.arange(24, dtype=torch.float32).reshape(SHAPE), "b": torch.arange(4, dtype=torch.float32)}
# rank 0: rows 0..2 of w and all of b; rank 1: rows 3..5 of w
BOXES = {0: [("w", Box((0, 0), (3, 4))), ("b", Box((0,), (4,)))], 1: [("w", Box((3, 0), (3, 4)))]}


def write(path: Path, boxes: dict[int, list[tuple[str, Box]]] = BOXES) -> tuple[list[Receipt], list]:
    storage = open_storage(str(path))
    receipts, summaries = [], []
    for rank, mine in boxes.items():
        chunks = []
        for name, box in mine:
            for c in chunk_boxes(box, 4, 32):  # 2 rows of w per chunk: several chunks per box
                chunks.append((name, c, FULL[name][c.relative_to(Box.full(FULL[name].shape))].clone()))
        rec = Receipt(rank)
        write_data_file(storage, rec, data_file_name(rank, "a1b2c3d4"), chunks, "raw")
        receipts.append(rec)
        summaries.append(write_rank_files(storage, rec, "a1b2c3d4", mine, {"seed": rank}, None))
    return receipts, summaries


def commit(path: Path, summaries: list) -> None:
    m, written = manifest_from_summaries(
        step=2,
        backend="cpu",
        layout=Layout(world_size=2, dp=2),
        metas=DESCS,
        summaries=summaries,
        trees={},
        env={},
    )
    publish(open_storage(str(path)), m, 2, written)
    assert m.total_bytes == sum(s.files[0][1] for s in summaries)


def test_v2_commit_holds_what_the_v1_commit_of_the_same_writes_holds(tmp_path: Path) -> None:
    receipts, summaries = write(tmp_path / "v2")
    assert [len(s.pieces) for s in summaries] == [2, 1]  # boxes, not chunks, go to rank 0
    commit(tmp_path / "v2", summaries)
    doc = assert_valid(tmp_path / "v2")
    assert doc["tensors"]["w"]["pieces"] == {"split": [[0, 2]], "ranks": {"start": 0, "steps": [1]}}
    assert sorted(e["holds"] for e in doc["rank_state"].values()) == [["rng"], ["rng"]]
    v1_receipts, _ = write(tmp_path / "v1")
    m1 = build_manifest(
        step=2,
        backend="cpu",
        layout=Layout(world_size=2, dp=2),
        metas=DESCS,
        receipts=v1_receipts,
        trees={},
        rank_trees={r: {"rng": {"seed": r}} for r in BOXES},
        env={},
    )
    publish(open_storage(str(tmp_path / "v1")), m1, version=1)
    a = read_manifest(open_storage(str(tmp_path / "v1")))
    b = read_manifest(open_storage(str(tmp_path / "v2")))
    assert (a.format_version, b.format_version) == (1, 2)
    key = {n: [(s.box, s.nbytes, s.checksum) for s in t.shards] for n, t in a.tensors.items()}
    assert key == {n: [(s.box, s.nbytes, s.checksum) for s in t.shards] for n, t in b.tensors.items()}
    assert a.rng == b.rng == {"0": {"seed": 0}, "1": {"seed": 1}}
    reader = CheckpointReader(str(tmp_path / "v2"), lazy=True)
    assert torch.equal(reader.read("w"), FULL["w"])
    assert reader.rank_trees(1) == ({"seed": 1}, None)


@pytest.mark.parametrize(
    ("boxes", "error"),
    [
        (
            {0: [("w", Box((0, 0), (3, 4))), ("b", Box((0,), (4,)))]},
            r"tensor 'w': written shards hold 12 of 24",
        ),
        (
            {0: [("w", Box((0, 0), (6, 4))), ("b", Box((0,), (4,)))], 1: [("w", Box((0, 0), (6, 4)))]},
            r"tensor 'w': box \[0, 0\]\+\[6, 4\] was written twice",
        ),
        (
            {0: [("w", Box((0, 0), (6, 4))), ("b", Box((0,), (4,))), ("x", Box((0,), (1,)))]},
            r"rank 0 wrote tensor 'x' that no rank described",
        ),
    ],
    ids=["gap", "twice", "unknown tensor"],
)
def test_rank_0_refuses_boxes_that_do_not_tile_the_tensors(tmp_path: Path, boxes: dict, error: str) -> None:
    summaries = [
        write_rank_files(open_storage(str(tmp_path)), Receipt(r), "a1b2c3d4", mine, None, None)
        for r, mine in boxes.items()
    ]
    with pytest.raises(ManifestError, match=error):
        manifest_from_summaries(
            step=2, backend="cpu", layout=Layout(), metas=DESCS, summaries=summaries, trees={}, env={}
        )


def test_a_box_outside_the_shape_is_refused(tmp_path: Path) -> None:
    _, summaries = write(tmp_path)
    summaries[1].pieces = [("w", (3, 0), (4, 4))]
    with pytest.raises(
        ManifestError, match=r"rank 1 wrote box \[3, 0\]\+\[4, 4\] of tensor 'w', which lies outside"
    ):
        commit(tmp_path, summaries)
    assert not (tmp_path / MANIFEST_NAME).exists()


def test_an_empty_tensor_has_one_empty_block_and_reads_back(tmp_path: Path) -> None:
    descs = [*DESCS, TensorDesc("empty", "buffer", (0, 4), "F32")]
    _, summaries = write(tmp_path)
    summaries[0].pieces.append(("empty", (0, 0), (0, 4)))  # written (nothing) by rank 0
    m, written = manifest_from_summaries(
        step=2, backend="cpu", layout=Layout(world_size=2), metas=descs, summaries=summaries, trees={}, env={}
    )
    publish(open_storage(str(tmp_path)), m, 2, written)
    assert assert_valid(tmp_path)["tensors"]["empty"]["pieces"] == {"split": [], "ranks": [-1]}
    assert CheckpointReader(str(tmp_path), lazy=True).read("empty").shape == (0, 4)
