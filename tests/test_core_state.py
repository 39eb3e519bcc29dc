"""What travels with a checkpoint besides tensors: tokenizer identity, GradScaler, data-loader state,
environment, user metadata; and the memory:// backend."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
import torch

import ckpt
from ckpt.errors import CkptError, ManifestError
from ckpt.state.tokenizer import identity


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))


def _hf_tokenizer(vocab: dict[str, int]):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_tokenizer_identity_from_object_and_folder(tmp_path):
    a = _hf_tokenizer({"[UNK]": 0, "hello": 1, "world": 2})
    b = _hf_tokenizer({"[UNK]": 0, "hello": 1, "there": 2})
    ida, ida2, idb = identity(a), identity(_hf_tokenizer({"[UNK]": 0, "hello": 1, "world": 2})), identity(b)
    assert ida["sha256"] == ida2["sha256"]
    assert ida["sha256"] != idb["sha256"]
    assert "tokenizer.json" in ida["files"]
    a.save_pretrained(tmp_path / "tok")
    folder = identity(str(tmp_path / "tok"))
    assert folder["sha256"] == ida["sha256"]
    with pytest.raises(CkptError, match="does not exist"):
        identity(str(tmp_path / "nope"))


def test_tokenizer_scaler_metadata_and_environment_in_manifest(tmp_path):
    m = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler.update(512.0)
    tok = _hf_tokenizer({"[UNK]": 0, "a": 1})
    meta = {"run": "exp-7", "seeds": (1, 2), "lr": 3e-4, "nan": float("nan")}
    path = str(tmp_path / "step_00000005")
    ckpt.save(path, step=5, model=m, scaler=scaler, tokenizer=tok, metadata=meta, progress={"tokens": 123})
    man = ckpt.open_checkpoint(path).manifest
    assert man.tokenizer["sha256"] == identity(tok)["sha256"]
    assert man.progress == {"step": 5, "tokens": 123}
    assert man.environment["versions"]["torch"] == metadata.version("torch")
    assert man.environment["world_size"] == 1
    assert "deterministic_algorithms" in man.environment
    scaler2 = torch.amp.GradScaler("cpu", init_scale=65536.0)
    res = ckpt.restore(path, model=_model(), scaler=scaler2)
    assert scaler2.state_dict() == scaler.state_dict()
    assert scaler2.get_scale() == 512.0
    assert res.metadata["seeds"] == (1, 2) and res.metadata["lr"] == 3e-4
    assert res.metadata["nan"] != res.metadata["nan"]


def test_stateful_dataloader_position_round_trip(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(3)
    dl = StatefulDataLoader(list(range(50)), batch_size=4, shuffle=True)
    it = iter(dl)
    for _ in range(3):
        next(it)
    path = str(tmp_path / "c")
    ckpt.save(path, step=3, model=_model(), dataloader=dl)
    expected = [next(it).tolist() for _ in range(4)]
    torch.manual_seed(99)
    dl2 = StatefulDataLoader(list(range(50)), batch_size=4, shuffle=True)
    ckpt.restore(path, model=_model(), dataloader=dl2, rng=False)
    it2 = iter(dl2)
    assert [next(it2).tolist() for _ in range(4)] == expected


def test_memory_filesystem_round_trip():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(3, 6)).sum().backward()
    opt.step()
    url = "memory://ckpt-test/run/step_00000001"
    ckpt.save(url, step=1, model=m, optimizer=opt)
    m2 = _model()
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    ckpt.restore(url, model=m2, optimizer=opt2)
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        opt.state_dict()["state"][0]["momentum_buffer"], opt2.state_dict()["state"][0]["momentum_buffer"]
    )
    infos = ckpt.list_checkpoints("memory://ckpt-test/run")
    assert [(i.step, i.status) for i in infos] == [(1, "committed")]


def test_strict_restore_names_missing_and_unexpected(tmp_path):
    path = str(tmp_path / "c")
    ckpt.save(path, step=1, model=_model())
    other = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2), torch.nn.Linear(2, 1))
    with pytest.raises(ckpt.StateMismatchError, match=r"missing from checkpoint: 2\.bias, 2\.weight"):
        ckpt.restore(path, model=other)
    res = ckpt.restore(path, model=other, strict=False)
    assert res.missing == ["2.bias", "2.weight"]
    wrong = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ckpt.StateMismatchError, match="shape"):
        ckpt.restore(path, model=wrong)


def test_newer_format_version_is_refused_with_upgrade_hint(tmp_path):
    path = tmp_path / "c"
    ckpt.save(str(path), step=1, model=_model())
    doc = json.loads((path / "manifest.json").read_text())
    doc["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="upgrade ckpt"):
        ckpt.open_checkpoint(str(path))
