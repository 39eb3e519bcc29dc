"""ZeRO-1 padding: an NxD tag with dp=3 whose parameters do not divide by 3 (fixtures/nxd/llama_zero1_pad_dp3, made
by torch_xla's own ZeroRedundancyOptimizer, see its README) imports, exports and restores exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt.converters import nxd
from ckpt.converters.convert import ConvertOptions, convert, load_config
from safetensors.torch import load_file

from ckpt import open_checkpoint, treecodec
from ckpt.layouts import bit_equal

ROOT = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_zero1_pad_dp3"
TAG = ROOT / "step_3"
DP = 3


@pytest.fixture(scope="module")
def truth() -> tuple[dict, dict, dict]:
    return (
        load_file(ROOT / "model.safetensors"),
        load_file(ROOT / "optimizer_full.safetensors"),
        load_config(str(ROOT / "config.json")),
    )


def _raw_optim(tag: Path) -> list[dict]:
    return [
        torch.load(tag / "optim" / f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt", weights_only=False)
        for d in range(DP)
    ]


def test_fixture_has_padding() -> None:
    """The point of the fixture: some parameters are padded (their dim 0 does not divide by dp=3)."""
    sd = _raw_optim(TAG)[0]
    padded = [p for p, s in sd["shape_info"].items() if s[0] % DP]
    assert len(padded) >= 5
    for p in padded:
        rows = sd["shape_info"][p][0]
        assert sd["base_state"][p]["exp_avg"].shape[0] * DP > rows


def test_import_is_ground_truth(truth, tmp_path: Path) -> None:
    model, optim, cfg = truth
    dst = tmp_path / "cuda"
    convert(str(TAG), str(dst), ConvertOptions(to="cuda", from_="neuron", config=cfg))
    r = open_checkpoint(str(dst))
    m = r.manifest
    assert set(r.names("parameter")) == set(model)
    for name, t in model.items():
        assert bit_equal(r.read(name), t), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert bit_equal(r.read(f"optim/{name}/{key}"), optim[f"{name}.{key}"]), (name, key)
        assert bit_equal(treecodec.decode(m.optimizer["state"][name]["step"]), optim[f"{name}.step"])
    assert m.step == 3


def test_export_equals_nxd_shards(truth, tmp_path: Path) -> None:
    """cuda -> NxD tag dp=3: every optimizer shard (padding rows included) equals what torch_xla wrote."""
    _, _, cfg = truth
    convert(str(TAG), str(tmp_path / "cuda"), ConvertOptions(to="cuda", config=cfg))
    out = tmp_path / "nxd" / "step_3"
    convert(
        str(tmp_path / "cuda"), str(out), ConvertOptions.neuron(format="nxd", tp=1, dp=DP, qkv_linear=True)
    )
    orig, new = _raw_optim(TAG), _raw_optim(out)
    for d in range(DP):
        o, n = orig[d], new[d]
        assert {p: list(s) for p, s in n["shape_info"].items()} == {
            p: list(s) for p, s in o["shape_info"].items()
        }
        assert set(n["base_state"]) == set(o["base_state"])
        for p, per in o["base_state"].items():
            assert set(n["base_state"][p]) == set(per)
            for k, v in per.items():
                assert n["base_state"][p][k].shape == v.shape, (d, p, k)
                assert bit_equal(n["base_state"][p][k], v), (d, p, k)
        assert n["param_groups"] == o["param_groups"]
    om = torch.load(TAG / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    nm = torch.load(out / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    assert list(nm) == list(om) and all(bit_equal(nm[k], v) for k, v in om.items())
    assert nxd.read_tag(out).meta.dp_size == DP
