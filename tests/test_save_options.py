"""The user-facing saves take SaveOptions' fields as plain keywords; Checkpointer.save takes ``options=``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import SaveOptions
from ckpt.format.reader import read_manifest
from ckpt.storage import open_storage


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32)}


def test_keywords_and_options_record_the_same_checkpoint(tmp_path: Path) -> None:
    ckpt.save(str(tmp_path / "kw"), step=4, model=_state(), rng=False, progress={"tokens": 9}, metadata={"a": 1})
    saver = ckpt.Checkpointer()
    opts = SaveOptions(rng=False, progress={"tokens": 9}, metadata={"a": 1})
    saver.save(str(tmp_path / "opt"), step=4, model=_state(), options=opts).result()
    saver.close()
    a, b = (read_manifest(open_storage(str(tmp_path / n))) for n in ("kw", "opt"))
    assert a.progress == b.progress == {"step": 4, "tokens": 9}
    assert a.user == b.user is not None
    assert a.rng_base is None and b.rng_base is None  # rng=False reached the saver both ways


@pytest.mark.parametrize("call", ["ckpt.save", "manager"])
def test_a_misspelled_keyword_is_a_type_error_naming_it_and_writes_nothing(tmp_path: Path, call: str) -> None:
    with pytest.raises(TypeError, match="'progres'"):
        if call == "ckpt.save":
            ckpt.save(str(tmp_path / "c"), step=1, model=_state(), progres={"tokens": 1})
        else:
            with ckpt.CheckpointManager(str(tmp_path), async_save=False) as mgr:
                mgr.save(1, model=_state(), progres={"tokens": 1})
    assert not any(tmp_path.rglob("manifest.json"))


def test_options_and_their_keywords_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="rng="):
        ckpt.save(str(tmp_path / "c"), step=1, model=_state(), options=SaveOptions(), rng=False)


def test_the_manager_keeps_its_own_on_commit(tmp_path: Path) -> None:
    with ckpt.CheckpointManager(str(tmp_path), async_save=False, keep_last=1) as mgr:
        with pytest.raises(TypeError, match="on_commit"):
            mgr.save(1, model=_state(), on_commit=print)
        mgr.save(1, model=_state(), options=SaveOptions(rng=False)).result()
        mgr.save(2, model=_state(), rng=False).result()
        assert [i.step for i in mgr.list()] == [2]  # retention ran: the manager's on_commit was used
