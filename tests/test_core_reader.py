"""CheckpointReader: lazy box reads, checksum verification, verify=False, truncated and missing files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.errors import CorruptionError
from ckpt.format.manifest import Box


@pytest.fixture(params=["raw", "zstd"])
def saved(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = {
        "big": torch.arange(60, dtype=torch.float32).reshape(10, 6),
        "small": torch.tensor([1, 2, 3], dtype=torch.int64),
        "half": torch.linspace(-1, 1, 8, dtype=torch.bfloat16).reshape(2, 4),
    }
    # 48-byte chunks: "big" is stored as 5 shards of 2 rows
    ckpt.Checkpointer(chunk_bytes=48, codec=request.param).save(
        str(tmp_path / "c"), step=3, model=state
    ).result()
    return tmp_path / "c", state


def test_reads_any_box_across_shards(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = saved
    reader = ckpt.open_checkpoint(str(path))
    assert len(reader.entry("big").shards) == 5
    assert sorted(reader.names()) == sorted(state)
    for offs, lens in [((0, 0), (10, 6)), ((3, 1), (4, 4)), ((9, 5), (1, 1)), ((2, 0), (0, 6))]:
        out = torch.full(lens, -1.0)
        reader.read_box_into("big", Box(offs, lens), out)
        assert torch.equal(out, state["big"][offs[0] : offs[0] + lens[0], offs[1] : offs[1] + lens[1]])
    assert dict(reader).keys() == state.keys()
    for name, t in reader:
        assert torch.equal(t, state[name]) and t.dtype == state[name].dtype


def test_unknown_tensor_and_wrong_destination_are_errors(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    reader = ckpt.open_checkpoint(str(saved[0]))
    with pytest.raises(ckpt.CkptError, match="no tensor named 'nope'"):
        reader.read("nope")
    with pytest.raises(ckpt.CkptError, match="destination shape"):
        reader.read_box_into("big", Box((0, 0), (2, 2)), torch.empty(3, 3))


def _shard_of(path: Path, name: str, row: int) -> tuple[Path, int, int]:
    e = ckpt.open_checkpoint(str(path)).entry(name)
    s = next(s for s in e.shards if s.box.offsets[0] <= row < s.box.offsets[0] + s.box.lengths[0])
    return path / s.file, s.offset, s.nbytes


def _flip(file: Path, at: int) -> None:
    with open(file, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("whole", [True, False], ids=["whole-tensor", "sub-box"])
def test_checksum_mismatch_names_file_and_tensor(
    saved: tuple[Path, dict[str, torch.Tensor]], whole: bool
) -> None:
    path, state = saved
    file, offset, nbytes = _shard_of(path, "big", row=4)
    _flip(file, offset + nbytes - 1)
    reader = ckpt.open_checkpoint(str(path))
    with pytest.raises(
        CorruptionError, match=rf"{file.name}: tensor 'big' shard at \[4, 0\]: checksum mismatch"
    ):
        if whole:
            reader.read("big")
        else:
            reader.read_box_into("big", Box((4, 2), (1, 2)), torch.empty(1, 2))
    # shards that were not damaged still read fine
    out = torch.empty(2, 6)
    reader.read_box_into("big", Box((0, 0), (2, 6)), out)
    assert torch.equal(out, state["big"][:2])
    # and a restore refuses too
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        ckpt.restore(str(path), model={k: torch.zeros_like(v) for k, v in state.items()}, rng=False)


def test_verify_false_skips_the_checksum(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = saved
    reader = ckpt.open_checkpoint(str(path))
    if reader.entry("big").shards[0].codec != "raw":
        pytest.skip("a flipped bit in a zstd frame does not map to a single element")
    file, offset, nbytes = _shard_of(path, "big", row=8)
    _flip(file, offset + 4)  # low bit of row 8, column 1
    got = ckpt.open_checkpoint(str(path), verify=False).read("big")
    diff = (got != state["big"]).nonzero().tolist()
    assert diff == [[8, 1]]
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    ckpt.restore(str(path), model=live, verify=False, rng=False)
    assert not torch.equal(live["big"], state["big"]) and torch.equal(live["small"], state["small"])


def test_truncated_file_is_detected(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = saved
    file, offset, nbytes = _shard_of(path, "big", row=9)
    os.truncate(file, offset + nbytes - 2)
    reader = ckpt.open_checkpoint(str(path), verify=False)
    with pytest.raises(CorruptionError, match=rf"{file.name}.*'big'.*short read"):
        reader.read("big")
    with pytest.raises(CorruptionError, match="short read"):
        reader.read_box_into("big", Box((9, 0), (1, 3)), torch.empty(1, 3))
    from ckpt.restoring.discovery import missing_files
    from ckpt.storage import open_storage

    assert missing_files(open_storage(path), reader.manifest) == [
        f"{file.name} ({offset + nbytes - 2} bytes, manifest says {reader.manifest.files[file.name].size})"
    ]


def test_missing_file_is_detected(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = saved
    file, _, _ = _shard_of(path, "small", row=0)
    file.unlink()
    with pytest.raises(CorruptionError, match=rf"{file.name}: missing \(holds tensor '(big|small|half)'\)"):
        ckpt.open_checkpoint(str(path)).read("small")


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ckpt.ManifestError, match="no such checkpoint directory"):
        ckpt.open_checkpoint(str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.ManifestError, match="not a committed checkpoint"):
        ckpt.open_checkpoint(str(tmp_path / "empty"))


def test_reads_from_s3(s3) -> None:  # noqa: ANN001
    w = torch.randn(7, 5)
    url = f"{s3.url}/c"
    ckpt.Checkpointer(chunk_bytes=40, storage_options=s3.storage_options).save(
        url, step=1, model={"w": w}
    ).result()
    reader = ckpt.open_checkpoint(url, s3.storage_options)
    out = torch.empty(3, 2)
    reader.read_box_into("w", Box((2, 1), (3, 2)), out)
    assert torch.equal(out, w[2:5, 1:3])
    assert torch.equal(reader.read("w"), w)
