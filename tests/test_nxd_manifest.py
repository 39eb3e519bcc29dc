"""NxD tags <-> Neuron-layout manifests: every fixture imports and merges to its ground truth bit for bit; a
manifest exported as an NxD tag reads back identically; tag status rules; safety; no torch_xla."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from ckpt.converters import nxd
from safetensors.torch import load_file
from xla_blocked import run_without_torch_xla

from ckpt.errors import CkptError, CorruptionError, UnsafePickleError
from ckpt.format import treecodec
from ckpt.format.reader import CheckpointReader
from ckpt.layouts import LayoutSpec, bit_equal, nxd_to_full_state

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"
CASES = {
    "train_plain": ("nxd_train_tp2_dp2_zero1_plain/step_3", dict(tp=2, qkv_linear=True)),
    "train_xser": ("nxd_train_tp2_dp2_zero1_xser/step_3", dict(tp=2, qkv_linear=True)),
    "from_full_tp2_pp2": ("nxd_from_full_tp2_pp2", dict(tp=2, pp=2)),
    "from_full_tp2_qkvlinear": ("nxd_from_full_tp2_qkvlinear", dict(tp=2, qkv_linear=True)),
}


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((FIX / "config.json").read_text())


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory, config: dict) -> dict[str, Path]:
    out = {}
    root = tmp_path_factory.mktemp("imported")
    for case, (rel, _flags) in CASES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # converter output is unmarked: picked explicitly here
            nxd.import_tag(FIX / rel, str(root / case), allow_unmarked=True, step=3, config=config)
        out[case] = root / case
    return out


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not bit_equal(got[k], want[k])]
    assert not bad, f"differ: {bad}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_merges_to_ground_truth(case: str, imported: dict[str, Path], config: dict) -> None:
    rel, flags = CASES[case]
    reader = CheckpointReader(str(imported[case]))
    m = reader.manifest
    spec = LayoutSpec.from_hf_config(config, hw="trn1", **flags)
    assert m.backend == "neuron" and m.layout.kind == "nxd"
    assert (m.layout.tp, m.layout.pp) == (spec.tp, spec.pp)
    nx = m.extra["nxd"]
    assert nx["rule_set"] == "nxd-llama" and nx["qkv_linear"] == spec.qkv_linear and nx["config"] == config
    # weights: the manifest's logical tensors cut into TP boxes and merged by the layout engine = HF model
    _same(
        nxd_to_full_state(nxd.rank_shards(reader), spec, verify_replicas=True),
        load_file(FIX / "model.safetensors"),
    )
    if not case.startswith("train"):
        assert m.optimizer is None
        return
    assert m.layout.dp == 2 and m.layout.zero_stage == 1
    truth = load_file(FIX / "optimizer_full.safetensors")
    for key in ("exp_avg", "exp_avg_sq"):
        shards = nxd.rank_shards(reader, roles=("optimizer_state",))
        per_key = {
            r: {n.split("/")[1]: t for n, t in sd.items() if n.endswith("/" + key)}
            for r, sd in shards.items()
        }
        full = nxd_to_full_state(per_key, spec, verify_replicas=True)
        _same(
            {f"{k}.{key}": v for k, v in full.items()},
            {k: v for k, v in truth.items() if k.endswith("." + key)},
        )
    steps = {p: treecodec.decode(s["step"]) for p, s in m.optimizer["state"].items()}
    assert len(steps) == 35 and all(bit_equal(s, torch.tensor(3.0)) for s in steps.values())
    group = m.optimizer["param_groups"][0]
    assert (
        len(group["params"]) == 35
        and treecodec.decode(group["lr"]) == json.loads((FIX / "truth.json").read_text())["lr_step4"]
    )
    assert treecodec.decode(m.scheduler) == json.loads((FIX / "scheduler.json").read_text())
    assert treecodec.decode(m.user) == {"total_steps": 3, "batch_idx": 3, "epoch": 0}
    assert m.step == 3


def _assert_tags_equal(a: nxd.NxdTag, b: nxd.NxdTag) -> None:
    assert sorted(a.per_rank_model) == sorted(b.per_rank_model)
    for k, sd in a.per_rank_model.items():
        assert list(sd) == list(b.per_rank_model[k])  # same names in the same (pid) order
        assert all(bit_equal(sd[n], b.per_rank_model[k][n]) for n in sd)
    assert sorted(a.per_rank_optimizer) == sorted(b.per_rank_optimizer)
    for k, oa in a.per_rank_optimizer.items():
        ob = b.per_rank_optimizer[k]
        assert list(oa["state"]) == list(ob["state"])
        for n, per in oa["state"].items():
            assert sorted(per) == sorted(ob["state"][n])
            assert all(bit_equal(v, ob["state"][n][key]) for key, v in per.items())
        assert oa["param_groups"] == ob["param_groups"]
        assert (oa["master_weights"] is None) == (ob["master_weights"] is None)
    assert a.scheduler == b.scheduler and a.user_content == b.user_content


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_reads_back_identically(case: str, imported: dict[str, Path], tmp_path: Path) -> None:
    rel, _ = CASES[case]
    out = nxd.export_tag(str(imported[case]), tmp_path / "nxd", "step_3")
    assert (out / "done").is_file() and nxd.tag_status(out).status is nxd.TagStatus.COMPLETE
    got = nxd.read_tag(out)
    orig = nxd.read_tag(FIX / rel)
    assert got.meta.xser == orig.meta.xser and got.meta.dp_size == orig.meta.dp_size
    _assert_tags_equal(orig, got)
    # and the exported tag imports to the same tensors again
    again = nxd.import_tag(out, str(tmp_path / "again"), step=3)
    first = CheckpointReader(str(imported[case]))
    second = CheckpointReader(str(tmp_path / "again"))
    assert list(first.manifest.tensors) == list(second.manifest.tensors)
    assert all(bit_equal(first.read(n), second.read(n)) for n in first.manifest.tensors)
    assert again.optimizer == first.manifest.optimizer


def test_export_reshards_zero1_for_another_dp_size(imported: dict[str, Path], tmp_path: Path) -> None:
    out = nxd.export_tag(str(imported["train_plain"]), tmp_path, "step_3", dp_size=3, xser=True)
    assert (
        len([p for p in (out / "optim").iterdir() if p.is_file() and p.name.endswith("_pp_rank_00.pt")]) == 6
    )
    got = nxd.read_tag(out)
    assert got.meta.xser and got.meta.dp_size == 3
    _assert_tags_equal(nxd.read_tag(FIX / CASES["train_plain"][0]), got)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_tag_status_rules_on_import(tmp_path: Path) -> None:
    tag = _copy(FIX / CASES["train_plain"][0], tmp_path / "step_3")
    (tag / "done").unlink()
    with pytest.raises(CkptError, match="allow_unmarked") as ei:
        nxd.import_tag(tag, str(tmp_path / "out"))
    assert "\n" not in str(ei.value) and "step_3" in str(ei.value)
    with pytest.warns(UserWarning, match="unmarked"):
        nxd.import_tag(tag, str(tmp_path / "out"), allow_unmarked=True)
    (tag / "optim" / "dp_rank_01_tp_rank_00_pp_rank_00.pt").unlink()
    with pytest.raises(CorruptionError, match="incomplete"):
        nxd.import_tag(tag, str(tmp_path / "out2"), allow_unmarked=True)
    assert not (tmp_path / "out2" / "manifest.json").exists()


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("victim", ["user_content.pt", "optim/dp_rank_01_tp_rank_01_pp_rank_00.pt"])
def test_malicious_pickle_is_refused_on_import(tmp_path: Path, victim: str) -> None:
    tag = _copy(FIX / CASES["train_plain"][0], tmp_path / "step_3")
    marker = tmp_path / "pwned"
    torch.save({"total_steps": _Evil(marker)}, tag / victim)
    with pytest.raises(UnsafePickleError, match=Path(victim).name):
        nxd.import_tag(tag, str(tmp_path / "out"))
    assert not marker.exists()
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_import_and_export_never_import_torch_xla(tmp_path: Path) -> None:
    run_without_torch_xla(
        f"""
nxd.import_tag({str(FIX / CASES["train_xser"][0])!r}, {str(tmp_path / "ck")!r})
out = nxd.export_tag({str(tmp_path / "ck")!r}, {str(tmp_path / "nxd")!r}, "step_3")
assert nxd.read_tag(out).meta.xser
"""
    )
