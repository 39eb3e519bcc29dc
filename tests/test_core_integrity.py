"""ckpt.format.integrity: coverage gaps/overlaps and file damage are each reported with the file and tensor."""

from __future__ import annotations

import torch
from manifest_io import rewrite_manifest

import ckpt
from ckpt.format.integrity import verify_checkpoint


def _save(path, chunk_bytes=64):
    saver = ckpt.Checkpointer(chunk_bytes=chunk_bytes)
    saver.save(str(path), step=1, model={"w": torch.arange(64, dtype=torch.float32).reshape(16, 4)}).result()
    return path


def _edit_manifest(path, fn):
    """Edit the manifest's shards and re-seal it, in the format version it is stored in (an unsealed edit would be
    refused as damaged before verify sees it)."""
    rewrite_manifest(path, fn)


def test_intact_checkpoint_has_no_problems(tmp_path):
    path = _save(tmp_path / "c")
    reader = ckpt.open_checkpoint(str(path))
    assert len(reader.manifest.tensors["w"].shards) == 4  # 256 bytes in 64-byte chunks
    assert verify_checkpoint(reader) == []


def test_gap_in_shards_is_reported(tmp_path):
    path = _save(tmp_path / "c")
    _edit_manifest(path, lambda d: d["tensors"]["w"]["shards"].pop(1))
    problems = verify_checkpoint(ckpt.open_checkpoint(str(path)))
    assert any(p.tensor == "w" and "48 of 64" in p.message for p in problems)


def test_overlapping_shards_are_reported(tmp_path):
    path = _save(tmp_path / "c")

    def dup(d):
        shards = d["tensors"]["w"]["shards"]
        shards[1] = dict(shards[0])
        shards[1]["offsets"] = [2, 0]

    _edit_manifest(path, dup)
    problems = verify_checkpoint(ckpt.open_checkpoint(str(path)))
    assert any(p.tensor == "w" and "overlapping" in p.message for p in problems)


def test_checksum_damage_names_file_and_tensor(tmp_path):
    path = _save(tmp_path / "c")
    reader = ckpt.open_checkpoint(str(path))
    shard = reader.manifest.tensors["w"].shards[2]
    data = path / shard.file
    raw = bytearray(data.read_bytes())
    raw[shard.offset] ^= 1
    data.write_bytes(bytes(raw))
    problems = verify_checkpoint(ckpt.open_checkpoint(str(path)))
    assert len(problems) == 1
    assert problems[0].file == shard.file and problems[0].tensor == "w" and "checksum" in problems[0].message
