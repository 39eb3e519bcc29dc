"""Format v2 (docs/format.md, "Version 2"): a small top manifest, one sealed index and state file per rank.

Checkpoints here are real: several StreamingWriters (one per simulated rank, as ranks under torchrun would) write
their boxes to disk and one commits every receipt, in v1 and in v2, so the two encodings of the same facts can be
compared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from manifest_schema import assert_valid

import ckpt
from ckpt.errors import CkptError, ManifestError
from ckpt.format.manifest import MANIFEST_NAME, Box, Layout, Manifest, seal
from ckpt.format.placement import blocks, blocks_overlapping, split
from ckpt.format.publish import publish
from ckpt.format.reader import CheckpointReader, read_manifest
from ckpt.saving.writer import StreamingWriter
from ckpt.storage import open_storage

WORLD = 4
SHAPES = {"emb": (10, 3), "norm": (4,), "w": (16, 4), "odd": (3, 5)}


def value(i: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 100 * i


def boxes_of(name: str, shape: tuple[int, ...]) -> dict[int, Box]:
    """Who stores what: 'norm' whole on rank 2 (replicated, one writer), 'odd' in irregular boxes, the rest dim-0
    FSDP splits over the 4 ranks."""
    if name == "norm":
        return {2: Box.full(shape)}
    if name == "odd":
        return {0: Box((0, 0), (1, 5)), 3: Box((1, 0), (2, 5))}
    out = {}
    for r in range(WORLD):
        off, n = split(shape[0], WORLD, r)
        out[r] = Box((off, *[0] * (len(shape) - 1)), (n, *shape[1:]))
    return out


def make(path: Path, version: int, chunk_bytes: int = 32) -> Manifest:
    storage = open_storage(str(path))
    writers = [
        StreamingWriter(storage, rank=r, attempt="a1b2c3d4", chunk_bytes=chunk_bytes) for r in range(WORLD)
    ]
    for i, (name, shape) in enumerate(SHAPES.items()):
        full = value(i, shape)
        for r, box in boxes_of(name, shape).items():
            writers[r].add(name, full[box.relative_to(Box.full(shape))], shape=shape, box=box)
    receipts = [w.finish() for w in writers]
    for w in writers:
        w.close()
    from ckpt.format.publish import build_manifest

    m = build_manifest(
        step=5,
        backend="cpu",
        layout=Layout(world_size=WORLD, dp=WORLD),
        metas=[m for w in writers for m in w.metas.values()],
        receipts=receipts,
        trees={
            "rng_base": {
                "rule": "carry-or-derive/1",
                "seed": 7,
                "source": "caller",
                "dp": WORLD,
                "shared": [],
            }
        },
        rank_trees={r: {"rng": {"seed": r}, "data": {"batch": 10 + r}} for r in range(WORLD)},
        env={},
    )
    publish(storage, m, version=version)
    return m


@pytest.fixture
def v2(tmp_path: Path) -> Path:
    path = tmp_path / "run" / "step_00000005"
    make(path, 2)
    return path


def test_v2_holds_the_same_facts_as_v1(tmp_path: Path, v2: Path) -> None:
    make(tmp_path / "v1", 1)
    a = read_manifest(open_storage(str(tmp_path / "v1")))
    b = read_manifest(open_storage(str(v2)))
    assert (a.format_version, b.format_version) == (1, 2)
    assert a.tensors == b.tensors and a.files == b.files
    assert a.rng == b.rng == {str(r): {"seed": r} for r in range(WORLD)}
    assert a.data == b.data
    for i, (name, shape) in enumerate(SHAPES.items()):
        assert torch.equal(ckpt.open_checkpoint(str(v2)).read(name), value(i, shape))


def test_top_manifest_has_no_chunks_and_describes_regular_pieces_once(v2: Path) -> None:
    doc = assert_valid(v2)
    assert doc["format_version"] == 2 and doc["rng"] == {} and doc["data"] == {}
    assert sorted(e["rank"] for e in doc["indexes"].values()) == list(range(WORLD))
    t = doc["tensors"]
    assert all("shards" not in e for e in t.values())
    assert t["w"]["pieces"] == {"split": [[0, 4]], "ranks": {"start": 0, "steps": [1]}}
    assert t["emb"]["pieces"] == {"split": [[0, 4]], "ranks": {"start": 0, "steps": [1]}}
    assert t["norm"]["pieces"] == {"split": [], "ranks": {"start": 2, "steps": []}}
    assert t["odd"]["pieces"] == {"boxes": [[[0, 0], [1, 5], 0], [[1, 0], [2, 5], 3]]}
    index = json.loads((v2 / "r00002-a1b2c3d4.index.json").read_text())
    assert index["rank"] == 2 and "rng" not in index and "data" not in index
    assert {c[0] for c in index["chunks"]} == {"emb", "w", "norm"}
    state = json.loads((v2 / "r00002-a1b2c3d4.state.json").read_text())
    assert state == {
        "checksum": doc["rank_state"]["r00002-a1b2c3d4.state.json"]["checksum"],
        "format": "ckpt-rank-state",
        "format_version": 2,
        "rank": 2,
        "rng": {"seed": 2},
        "data": {"batch": 12},
    }
    assert doc["rank_state"]["r00002-a1b2c3d4.state.json"]["holds"] == ["rng", "data"]


def test_a_restoring_rank_reads_only_the_indexes_it_needs(v2: Path) -> None:
    reader = CheckpointReader(str(v2), lazy=True)
    assert all(not e.shards for e in reader.manifest.tensors.values())
    out = torch.empty(4, 4)
    reader.read_box_into("w", Box((4, 0), (4, 4)), out)  # rank 1's box of w
    assert torch.equal(out, value(2, (16, 4))[4:8])
    assert sorted(reader.locator.layout.loaded) == [1]
    reader.read_box_into("w", Box((6, 0), (4, 4)), out)  # across ranks 1 and 2
    assert torch.equal(out, value(2, (16, 4))[6:10])
    assert sorted(reader.locator.layout.loaded) == [1, 2]
    assert reader.rank_trees(3) == ({"seed": 3}, {"batch": 13})
    assert sorted(reader.locator.layout.loaded) == [
        1,
        2,
    ]  # a rank's trees are in its state file, not its index


def test_a_damaged_or_inconsistent_state_file_is_refused(v2: Path) -> None:
    p = v2 / "r00001-a1b2c3d4.state.json"
    doc = json.loads(p.read_text())
    doc["rng"] = {"seed": 99}
    p.write_text(seal(doc))
    with pytest.raises(ManifestError, match=r"r00001-a1b2c3d4.state.json is damaged or replaced"):
        CheckpointReader(str(v2), lazy=True).rank_trees(1)
    top = json.loads((v2 / MANIFEST_NAME).read_text())
    del top["rank_state"]
    with pytest.raises(ManifestError, match=r"field 'rank_state' must be an object .*a draft of format 2"):
        Manifest.from_json(seal(top))


def test_restore_reads_its_rng_from_its_own_state_file(v2: Path) -> None:
    model = {n: torch.zeros(s) for n, s in SHAPES.items()}
    res = ckpt.restore(str(v2), model=model, rng=False)
    assert res.step == 5
    assert all(torch.equal(model[n], value(i, s)) for i, (n, s) in enumerate(SHAPES.items()))


def test_a_replaced_index_is_refused_even_when_resealed(v2: Path) -> None:
    p = v2 / "r00001-a1b2c3d4.index.json"
    doc = json.loads(p.read_text())
    doc["chunks"][0][7] = (
        "xxh3_64:0000000000000000"  # another checksum, re-sealed: the index itself is intact
    )
    p.write_text(seal(doc))
    with pytest.raises(ManifestError, match=r"r00001-a1b2c3d4.index.json is damaged or replaced"):
        read_manifest(open_storage(str(v2)))
    # listing reads the top manifest alone: still committed
    assert [i.status for i in ckpt.list_checkpoints(str(v2.parent))] == ["committed"]


def test_a_missing_index_is_named(v2: Path) -> None:
    (v2 / "r00003-a1b2c3d4.index.json").unlink()
    with pytest.raises(ManifestError, match=r"r00003-a1b2c3d4.index.json: missing \(index of rank 3"):
        read_manifest(open_storage(str(v2)))
    reader = CheckpointReader(str(v2), lazy=True)
    reader.read_box_into("norm", Box((0,), (4,)), torch.empty(4))  # rank 2's: still readable
    with pytest.raises(CkptError, match="index of rank 3"):
        reader.read_box_into("w", Box((12, 0), (4, 4)), torch.empty(4, 4))


def test_a_v2_tensor_with_shards_is_refused(v2: Path) -> None:
    doc = json.loads((v2 / MANIFEST_NAME).read_text())
    doc["tensors"]["w"]["shards"] = []
    with pytest.raises(ManifestError, match=r"tensor 'w': 'shards' is not a format_version 2 member"):
        Manifest.from_json(seal(doc))


def test_pieces_naming_a_rank_without_index_are_refused(v2: Path) -> None:
    doc = json.loads((v2 / MANIFEST_NAME).read_text())
    doc["tensors"]["norm"]["pieces"] = {"split": [], "ranks": [7]}
    with pytest.raises(ManifestError, match=r"tensor 'norm': pieces name rank 7, which has no index"):
        Manifest.from_json(seal(doc))


def test_verify_and_retention_see_the_indexes(v2: Path) -> None:
    from ckpt.format.integrity import verify_checkpoint

    assert verify_checkpoint(ckpt.open_checkpoint(str(v2))) == []
    (v2 / "leftover.bin").write_bytes(b"x")
    mgr = ckpt.CheckpointManager(str(v2.parent), async_save=False)
    mgr.apply_retention(5)
    assert not (v2 / "leftover.bin").exists()  # swept ...
    assert len(list(v2.glob("*.index.json"))) == WORLD  # ... the indexes kept
    assert len(list(v2.glob("*.state.json"))) == WORLD  # ... and the state files
    assert verify_checkpoint(ckpt.open_checkpoint(str(v2))) == []


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
    data=st.data(),
)
def test_blocks_overlapping_is_the_brute_force_answer(shape: tuple[int, ...], data: st.DataObject) -> None:
    levels = data.draw(
        st.lists(st.tuples(st.integers(0, len(shape) - 1), st.integers(1, 4)), max_size=3), label="levels"
    )
    offs = tuple(data.draw(st.integers(0, n)) for n in shape)
    lens = tuple(data.draw(st.integers(0, n - o)) for n, o in zip(shape, offs, strict=True))
    want = Box(offs, lens)
    brute = [
        (i, b)
        for i, b in blocks(shape, levels)
        if b.numel and (x := b.intersect(want)) is not None and x.numel
    ]
    assert list(blocks_overlapping(shape, levels, want)) == brute
    # the blocks tile the tensor
    assert sum(b.numel for _, b in blocks(shape, levels)) == torch.Size(shape).numel()


def test_an_affine_formula_naming_a_rank_without_index_is_refused_when_read(v2: Path) -> None:
    doc = json.loads((v2 / MANIFEST_NAME).read_text())
    doc["tensors"]["w"]["pieces"]["ranks"] = {"start": 5, "steps": [1]}
    (v2 / MANIFEST_NAME).write_text(seal(doc))
    reader = CheckpointReader(str(v2), lazy=True)
    with pytest.raises(ManifestError, match=r"pieces name rank 5, which has no index"):
        reader.read_box_into("w", Box((0, 0), (16, 4)), torch.empty(16, 4))


def test_inspect_shows_a_v2_checkpoint_without_reading_every_index(v2: Path) -> None:
    from ckpt.cli.main import cli
    from click.testing import CliRunner

    for r in (0, 1, 2, 3):  # the table and the rng line need rank 0's state file at most, no index
        p = v2 / f"r{r:05d}-a1b2c3d4.index.json"
        p.rename(p.with_suffix(".moved"))
    r = CliRunner().invoke(cli, ["inspect", str(v2)])
    # the table is shown without an index; the stat of each listed file (issue 37) then finds them gone: exit 1
    assert r.exit_code == 1, r.output
    assert "format v2" in r.stdout and "4 pieces" in r.stdout and "2 pieces" in r.stdout
    assert r.stderr.count("index.json: missing") == 4, r.stderr
    r = CliRunner().invoke(cli, ["inspect", str(v2), "--json"])  # every chunk: reads every index
    assert r.exit_code == 2 and "r00000-a1b2c3d4.index.json: missing" in r.output


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (lambda c: c.__setitem__(2, [9, 4]), r"chunk 0: box \[0, 0\]\+\[9, 4\] lies outside shape \[10, 3\]"),
        (lambda c: c.__setitem__(3, "other.safetensors"), r"chunk 0: file 'other.safetensors' is not listed"),
        (lambda c: c.__setitem__(5, 8), r"chunk 0: nbytes 8 does not match its box \(24 bytes\)"),
        (lambda c: c.__setitem__(7, "xxh3_64:XYZ"), r"chunk 0: bad checksum 'xxh3_64:XYZ'"),
        (lambda c: c.__setitem__(4, 10**9), r"chunk 0: bytes 1000000000\.\.1000000024 lie outside"),
    ],
    ids=["box", "file", "nbytes", "checksum", "range"],
)
def test_a_bad_chunk_in_a_consistently_sealed_index_is_named(v2: Path, edit: Any, error: str) -> None:
    """An index whose seal and top-manifest checksum agree (written by a buggy tool) is still validated."""
    p = v2 / "r00000-a1b2c3d4.index.json"
    doc = json.loads(p.read_text())
    assert doc["chunks"][0][:3] == ["emb", [0, 0], [2, 3]]
    edit(doc["chunks"][0])
    text = seal(doc)
    p.write_text(text)
    top = json.loads((v2 / MANIFEST_NAME).read_text())
    top["indexes"][p.name].update(checksum=text[13:37], size=len(text.encode()))
    (v2 / MANIFEST_NAME).write_text(seal(top))
    with pytest.raises(ManifestError, match=error):
        read_manifest(open_storage(str(v2)))
