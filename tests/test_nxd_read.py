"""converters.nxd reading: every fixture against its ground truth, tag discovery, safety, no torch_xla."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from ckpt.converters import nxd
from safetensors.torch import load_file
from xla_blocked import run_without_torch_xla

from ckpt.errors import CkptError, StateMismatchError, UnsafePickleError

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"
PLAIN = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
XSER = FIX / "nxd_train_tp2_dp2_zero1_xser" / "step_3"
PP2 = FIX / "nxd_from_full_tp2_pp2"
TP = 2


@pytest.fixture(scope="module")
def full_model() -> dict[str, torch.Tensor]:
    return load_file(FIX / "model.safetensors")


@pytest.fixture(scope="module")
def full_optim() -> dict[str, torch.Tensor]:
    return load_file(FIX / "optimizer_full.safetensors")


def _rows(t: torch.Tensor, r: int) -> torch.Tensor:
    n = t.shape[0] // TP
    return t[r * n : (r + 1) * n]


def _cols(t: torch.Tensor, r: int) -> torch.Tensor:
    n = t.shape[1] // TP
    return t[:, r * n : (r + 1) * n]


def expected_local(full: dict[str, torch.Tensor], name: str, r: int, suffix: str = "") -> torch.Tensor:
    """TP-local tensor of rank r for an NxD name, from HF-named full tensors (trn1, kv_size_multiplier 1, tp 2:
    each rank holds 4 contiguous q heads and 1 kv head, per the fixture READMEs)."""

    def f(n: str) -> torch.Tensor:
        return full[n + suffix]

    m = re.match(r"(model\.layers\.\d+)\.self_attn\.qkv_proj\.weight_([qkv])$", name)
    if m:
        return _rows(f(f"{m.group(1)}.self_attn.{m.group(2)}_proj.weight"), r)
    if name.endswith("mlp.gate_up_proj.weight"):
        p = name[: -len("gate_up_proj.weight")]
        return torch.cat([_rows(f(p + "gate_proj.weight"), r), _rows(f(p + "up_proj.weight"), r)])
    if any(k in name for k in ("q_proj", "k_proj", "v_proj", "embed_tokens", "lm_head")):
        return _rows(f(name), r)
    if "o_proj" in name or "down_proj" in name:
        return _cols(f(name), r)
    return f(name)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("tag_dir", [PLAIN, XSER], ids=["plain", "xser"])
def test_training_tag_matches_ground_truth(tag_dir: Path, full_model, full_optim) -> None:
    tag = nxd.read_tag(tag_dir)
    m = tag.meta
    assert (m.tp_size, m.pp_size, m.dp_size, m.ep_size) == (2, 1, 2, 1)
    assert m.zero1 and m.xser == (tag_dir == XSER) and m.status is nxd.TagStatus.COMPLETE and m.step == 3
    assert sorted(tag.per_rank_model) == [(0, 0, 0), (1, 0, 0)]
    for (tp, _, _), sd in tag.per_rank_model.items():
        assert len(sd) == 35
        for name, t in sd.items():
            assert _bitwise(t, expected_local(full_model, name, tp)), name
        opt = tag.per_rank_optimizer[(tp, 0, 0)]
        assert list(opt["state"]) == list(sd)  # pid order = model key order (single param group)
        assert opt["param_groups"][0]["params"] == list(sd)
        assert opt["param_groups"][0]["lr"] == pytest.approx(0.000999743108100344)
        assert opt["master_weights"] is None
        for name, st in opt["state"].items():
            assert _bitwise(st["exp_avg"], expected_local(full_optim, name, tp, ".exp_avg")), name
            assert _bitwise(st["exp_avg_sq"], expected_local(full_optim, name, tp, ".exp_avg_sq")), name
            assert float(st["step"]) == 3.0
    assert tag.scheduler == json.loads((FIX / "scheduler.json").read_text())
    assert tag.user_content == {"total_steps": 3, "batch_idx": 3, "epoch": 0}


def test_converter_output_tp2_pp2(full_model) -> None:
    for path in (PP2, PP2 / "model"):
        tag = nxd.read_tag(path)
        assert (tag.meta.tp_size, tag.meta.pp_size, tag.meta.dp_size) == (2, 2, 1)
        assert tag.meta.status is nxd.TagStatus.UNMARKED and not tag.meta.xser and not tag.per_rank_optimizer
        assert tag.scheduler is None and tag.user_content is None
        names_pp = {pp: set() for pp in range(2)}
        for (tp, pp, _), sd in tag.per_rank_model.items():
            names_pp[pp] |= set(sd)
            for name, t in sd.items():
                assert _bitwise(t, expected_local(full_model, name, tp)), name
        assert "model.embed_tokens.weight" in names_pp[0] and "lm_head.weight" in names_pp[1]
        assert any(".layers.2." in n for n in names_pp[1]) and not any(".layers.2." in n for n in names_pp[0])


def test_lazy_reader_matches_full_read() -> None:
    r = nxd.open_tag(XSER)
    assert r.ranks == [(0, 0, 0), (1, 0, 0)]
    full = nxd.read_tag(PLAIN)
    sd = r.model((1, 0, 0))
    assert all(torch.equal(sd[k], full.per_rank_model[(1, 0, 0)][k]) for k in sd)
    shapes = r.model_shapes((0, 0, 0))
    assert shapes[1] == ("model.layers.0.self_attn.qkv_proj.weight_q", (32, 64))
    opt = r.optimizer((1, 0, 0))
    ref = full.per_rank_optimizer[(1, 0, 0)]["state"]
    assert all(torch.equal(opt["state"][k]["exp_avg"], ref[k]["exp_avg"]) for k in ref)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_status_complete_unmarked_incomplete(tmp_path: Path) -> None:
    for src in (PLAIN, XSER):
        t = _copy(src, tmp_path / src.parent.name / "step_3")
        assert nxd.tag_status(t).status is nxd.TagStatus.COMPLETE
        (t / "done").unlink()
        assert nxd.tag_status(t).status is nxd.TagStatus.UNMARKED
        if src is XSER:
            victim = t / "optim" / "dp_rank_01_tp_rank_00_pp_rank_00.pt.tensors" / "tensor_4.pt"
        else:
            victim = t / "optim" / "dp_rank_01_tp_rank_00_pp_rank_00.pt"
        data = victim.read_bytes()
        victim.unlink()
        info = nxd.tag_status(t)
        assert info.status is nxd.TagStatus.INCOMPLETE and info.problems
        victim.write_bytes(data[: len(data) // 2])  # torn write
        assert nxd.tag_status(t).status is nxd.TagStatus.INCOMPLETE
        victim.write_bytes(data)
        assert nxd.tag_status(t).status is nxd.TagStatus.UNMARKED
        (t / "done").write_text("1")
        (t / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt").unlink()
        info = nxd.tag_status(t)  # NxD trusts done; we report the tag damaged, with what is missing
        assert info.status is nxd.TagStatus.DAMAGED and any("tp 1" in p for p in info.problems)


def test_list_tags_orders_by_step_not_mtime(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    for i, step in enumerate([100, 10, 9]):
        t = _copy(PLAIN, root / f"step_{step}")
        for p in t.rglob("*"):
            os.utime(p, (1_000_000 + i, 1_000_000 + i))  # step_9 newest by mtime, step_100 oldest
    (root / "step_100" / "done").unlink()  # crashed async save: all files but no done
    (root / "notes").mkdir()
    tags = nxd.list_tags(root)
    assert [t.name for t in tags] == ["step_9", "step_10", "step_100"]
    assert [t.status for t in tags] == [
        nxd.TagStatus.COMPLETE,
        nxd.TagStatus.COMPLETE,
        nxd.TagStatus.UNMARKED,
    ]
    assert nxd.latest_tag(root).name == "step_10"
    assert nxd.latest_tag(root, allow_unmarked=True).name == "step_100"


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_model_file_is_refused(tmp_path: Path) -> None:
    t = _copy(PLAIN, tmp_path / "step_3")
    marker = tmp_path / "pwned"
    torch.save(
        {"model.embed_tokens.weight": _Evil(marker)}, t / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt"
    )
    with pytest.raises(UnsafePickleError, match="dp_rank_00_tp_rank_01_pp_rank_00.pt"):
        nxd.read_tag(t)
    assert not marker.exists()


def test_shape_info_disagreeing_with_model_fails_clearly(tmp_path: Path) -> None:
    t = _copy(PLAIN, tmp_path / "step_3")
    for dp in range(2):
        f = t / "optim" / f"dp_rank_{dp:02d}_tp_rank_00_pp_rank_00.pt"
        d = torch.load(f, weights_only=True)
        d["shape_info"][1] = [33, 64]
        torch.save(d, f)
    with pytest.raises(StateMismatchError, match=r"pid 1 has shape_info \[33, 64\]") as ei:
        nxd.open_tag(t).optimizer((0, 0, 0))
    assert "\n" not in str(ei.value) and "dp_rank_00_tp_rank_00_pp_rank_00.pt" in str(ei.value)


def test_tp_rank_holding_other_tensors_than_its_peer_is_refused(tmp_path: Path) -> None:
    """A TP rank file whose tensor differs in dtype from TP rank 0's of the same stage: named before any read."""
    from ckpt.converters.nxd.source import NxdTagSource

    from ckpt.errors import CorruptionError

    t = _copy(PP2, tmp_path / "tag")
    f = t / "model" / "dp_rank_00_tp_rank_01_pp_rank_01.pt"
    sd = torch.load(f, weights_only=True)
    name = sorted(sd)[0]
    sd[name] = sd[name].to(torch.float64)
    torch.save(sd, f)
    with pytest.raises(
        CorruptionError,
        match=rf"rank tp 1 pp 1 holds {re.escape(name)} \[.*\] torch\.float64, unlike tp 0 of its stage",
    ):
        NxdTagSource(t)


def test_explicit_param_names_are_checked() -> None:
    r = nxd.open_tag(PLAIN)
    names = [n for n, _ in r.model_shapes((0, 0, 0))]
    wrong = [names[1], names[0], *names[2:]]
    with pytest.raises(StateMismatchError, match="pid 0"):
        nxd.open_tag(PLAIN, param_names={(0, 0, 0): wrong}).optimizer((0, 0, 0))
    assert list(nxd.open_tag(PLAIN, param_names={(0, 0, 0): names}).optimizer((0, 0, 0))["state"]) == names


def test_legacy_layouts(tmp_path: Path) -> None:
    sd = nxd.read_tag(PP2).per_rank_model
    root = tmp_path / "legacy"
    for (tp, pp, _), d in sd.items():
        folder = root / f"tp_rank_{tp:02d}_pp_rank_{pp:02d}"
        folder.mkdir(parents=True)
        torch.save({"model": d, "epoch": 1} if tp else d, folder / "checkpoint.pt")
    tag = nxd.read_tag(root)
    assert tag.meta.legacy and (tag.meta.tp_size, tag.meta.pp_size) == (2, 2)
    for k, d in sd.items():
        assert all(torch.equal(tag.per_rank_model[k][n], d[n]) for n in d)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CkptError, match="no NxD rank files"):
        nxd.read_tag(tmp_path)


def test_reading_never_imports_torch_xla(tmp_path: Path) -> None:
    run_without_torch_xla(
        f"""
for p in ({str(XSER)!r}, {str(PLAIN)!r}):
    tag = nxd.read_tag(p)
    assert len(tag.per_rank_optimizer) == 2
nxd.write_tag(tag, {str(tmp_path)!r}, "step_3", xser=True)
assert nxd.read_tag({str(tmp_path / "step_3")!r}).meta.xser
"""
    )
