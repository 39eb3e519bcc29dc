"""StreamingWriter: tensors added one at a time land in bounded data files, written in the background."""

from __future__ import annotations

import os

import pytest
import torch

import ckpt
from ckpt.format.manifest import Box
from ckpt.saving.writer import StreamingWriter


@pytest.mark.parametrize("background", [True, False])
def test_many_tensors_stream_into_several_files_and_read_back(tmp_path, background):
    torch.manual_seed(0)
    tensors = {f"t{i}": torch.randn(64, 33) for i in range(10)}
    w = StreamingWriter(str(tmp_path / "c"), flush_bytes=3 * 64 * 33 * 4, background=background)
    for name, t in tensors.items():
        w.add(name, t[:40], shape=(64, 33), box=Box((0, 0), (40, 33)))
        w.add(name, t[40:], shape=(64, 33), box=Box((40, 0), (24, 33)))
    m = w.commit(step=7, backend="cpu")
    assert len(m.files) >= 3
    r = ckpt.open_checkpoint(str(tmp_path / "c"))
    for name, t in tensors.items():
        assert torch.equal(r.read(name), t)


def test_background_write_error_surfaces_and_nothing_is_committed(tmp_path, monkeypatch):
    import ckpt.format.datafile as writer_mod  # write_data_file imports it from here at call time

    calls = {"n": 0}
    real = writer_mod.write_shard_file

    def failing(f, chunks, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real(f, chunks, *a, **k)

    monkeypatch.setattr(writer_mod, "write_shard_file", failing)
    w = StreamingWriter(str(tmp_path / "c"), flush_bytes=1)
    w.add("a", torch.ones(4))
    w.add("b", torch.ones(4))
    with pytest.raises(OSError, match="disk full"):
        w.add("c", torch.ones(4))
        w.commit(step=1, backend="cpu")
    w.abort()
    assert not os.path.exists(tmp_path / "c" / "manifest.json")
    assert [f for f in os.listdir(tmp_path / "c") if f.endswith(".safetensors")] == []
