"""Asynchronous saves: staging isolates the checkpoint from later training steps; background failures never
commit and surface at the next save/wait/close; one save in flight; committed steps are create-only."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
import ckpt.format.publish
from ckpt import SaveOptions
from ckpt.errors import AsyncSaveError, CheckpointExistsError
from ckpt.format.manifest import MANIFEST_NAME

pytestmark = pytest.mark.timeout(60)


def gated_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the background writer wait for the returned event before writing (with the real writer)."""
    gate = threading.Event()
    real = ckpt.format.publish.write_data_file

    def write(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(30), "test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt.format.publish, "write_data_file", write)
    return gate


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def clone_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {n: t.detach().clone() for n, t in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            out[f"{i}/{k}"] = v.clone()
    return out


def test_async_save_holds_the_values_from_before_the_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = make()
    step(model, opt)
    before = clone_state(model, opt)
    gate = gated_writer(monkeypatch)
    saver = ckpt.Checkpointer(async_save=True)
    fut = saver.save(str(tmp_path / "c"), step=1, model=model, optimizer=opt)
    assert not fut.done()  # the writer is held at the gate: nothing has been written yet
    step(model, opt)  # mutates parameters and optimizer moments in place
    after = clone_state(model, opt)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    gate.set()
    result = saver.wait()
    assert result is not None and result.step == 1 and fut.result() == result
    saver.close()

    m2, o2 = make()
    ckpt.restore(str(tmp_path / "c"), model=m2, optimizer=o2, rng=False)
    restored = clone_state(m2, o2)
    for k in before:
        assert torch.equal(restored[k], before[k]), k


def test_background_failure_commits_nothing_and_raises_at_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk on fire")

    monkeypatch.setattr(ckpt.format.publish, "write_data_file", broken)
    model, opt = make()
    saver = ckpt.Checkpointer(async_save=True)
    saver.save(str(tmp_path / "c"), step=1, model=model, optimizer=opt)
    with pytest.raises(AsyncSaveError, match="disk on fire"):
        saver.wait()
    assert not (tmp_path / "c" / MANIFEST_NAME).exists()
    assert saver.wait() is None  # raised once
    with pytest.raises(ckpt.ManifestError, match="no such checkpoint|not a committed checkpoint"):
        ckpt.open_checkpoint(str(tmp_path / "c"))
    # the same step can be saved again once the problem is gone
    monkeypatch.undo()
    saver.save(str(tmp_path / "c"), step=1, model=model, optimizer=opt)
    saver.close()
    assert (tmp_path / "c" / MANIFEST_NAME).exists()


@pytest.mark.parametrize("surface", ["next save", "close"])
def test_background_failure_raises_at_the_next_save_or_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, surface: str
) -> None:
    monkeypatch.setattr(
        ckpt.format.publish, "write_data_file", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    model, opt = make()
    saver = ckpt.Checkpointer(async_save=True)
    saver.save(str(tmp_path / "c1"), step=1, model=model, optimizer=opt)
    with pytest.raises(AsyncSaveError, match="boom"):
        if surface == "close":
            saver.close()
        else:
            saver.save(str(tmp_path / "c2"), step=2, model=model, optimizer=opt)
    assert not (tmp_path / "c1" / MANIFEST_NAME).exists()
    assert not (tmp_path / "c2" / MANIFEST_NAME).exists()  # the failed save was raised before starting step 2


def test_storage_failure_at_commit_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt.errors import StorageError
    from ckpt.storage import Storage

    real = Storage.put_bytes

    def put_bytes(self: Storage, rel: str, data: bytes, exclusive: bool = True) -> None:
        if rel == MANIFEST_NAME:
            raise StorageError(f"writing {self.display(rel)} failed: SlowDown")
        real(self, rel, data, exclusive)

    monkeypatch.setattr(Storage, "put_bytes", put_bytes)
    model, _ = make()
    saver = ckpt.Checkpointer(async_save=True)
    saver.save(str(tmp_path / "c"), step=1, model=model)
    with pytest.raises(AsyncSaveError, match="rank 0 commit.*SlowDown"):
        saver.close()
    assert not (tmp_path / "c" / MANIFEST_NAME).exists()
    # data only (and in format v2 the rank's index and state file, written before the top manifest): uncommitted
    left = [p.name for p in (tmp_path / "c").iterdir()]
    assert [n for n in left if not n.endswith((".index.json", ".state.json"))] == [
        n for n in left if n.endswith(".safetensors")
    ]
    assert [n for n in left if n.endswith(".safetensors")]


def test_one_save_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = gated_writer(monkeypatch)
    model, opt = make()
    saver = ckpt.Checkpointer(async_save=True)
    first = saver.save(str(tmp_path / "c1"), step=1, model=model, optimizer=opt)
    assert not first.done()
    opener = threading.Timer(0.2, gate.set)
    opener.start()
    second = saver.save(str(tmp_path / "c2"), step=2, model=model, optimizer=opt)
    # save() of step 2 returned only after step 1 was complete and committed
    assert first.done() and first.exception() is None
    assert (tmp_path / "c1" / MANIFEST_NAME).exists()
    saver.close()
    assert second.result().step == 2
    opener.join()


@pytest.mark.parametrize("async_save", [False, True])
def test_saving_an_existing_step_is_refused_unless_overwrite(tmp_path: Path, async_save: bool) -> None:
    path = str(tmp_path / "c")
    saver = ckpt.Checkpointer(async_save=async_save)
    saver.save(path, step=5, model={"w": torch.ones(3)})
    saver.wait()
    with pytest.raises(CheckpointExistsError, match="step 5 is committed"):
        saver.save(path, step=5, model={"w": torch.zeros(3)})
    assert torch.equal(ckpt.open_checkpoint(path).read("w"), torch.ones(3))
    saver.save(path, step=5, model={"w": torch.full((3,), 2.0)}, options=SaveOptions(overwrite=True))
    saver.close()
    assert torch.equal(ckpt.open_checkpoint(path).read("w"), torch.full((3,), 2.0))
