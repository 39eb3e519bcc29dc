"""Our layouts against NxD-written files (fixtures/nxd/llama_gqa_h64, see the READMEs there).

* ``nxd_from_full_tp2_pp2``: NxD 0.18 converter, ``--tp_size 2 --pp_size 2 --hw_backend trn1``.
* ``nxd_from_full_tp2_qkvlinear``: ``--tp_size 2 --pp_size 1 --hw_backend trn1 --qkv_linear 1
  --kv_size_multiplier 1``.
* ``nxd_train_tp2_dp2_zero1_plain/step_3``: ``save_checkpoint`` with a ZeRO-1 optimizer, dp=2, model files
  as in ``nxd_from_full_tp2_qkvlinear``; moments sharded like the weights.

Both converter cases are ones where NxD's converter is correct (kv_size_multiplier 1, tp == kv_heads), so our
output must equal its output bit for bit, and merging its output must give ``model.safetensors`` back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt.converters.nxd.zero1 import merge_zero1_optimizer, shard_zero1_optimizer
from safetensors.torch import load_file

from ckpt.errors import LayoutError
from ckpt.layouts import (
    LayoutSpec,
    TensorMeta,
    bit_equal,
    full_state_to_nxd,
    nxd_to_full_state,
    plan_nxd_to_full,
    rank_shards_to_full,
)
from ckpt.layouts.gqa import kv_heads_of_rank, q_heads_of_rank

ROOT = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"

CASES = {
    "nxd_from_full_tp2_pp2": dict(tp=2, pp=2, hw="trn1"),
    "nxd_from_full_tp2_qkvlinear": dict(tp=2, pp=1, hw="trn1", qkv_linear=True, kv_size_multiplier=1),
}


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((ROOT / "config.json").read_text())


@pytest.fixture(scope="module")
def full() -> dict[str, torch.Tensor]:
    return load_file(ROOT / "model.safetensors")


def load_rank_files(folder: Path, spec: LayoutSpec) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    return {
        (t, p): torch.load(folder / f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt", weights_only=True)
        for t, p in spec.ranks
    }


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not bit_equal(got[k], want[k])]
    assert not bad, f"differ: {bad}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_full_to_nxd_equals_nxd_converter(case, config, full):
    spec = LayoutSpec.from_hf_config(config, **CASES[case])
    nxd = load_rank_files(ROOT / case / "model", spec)
    ours = full_state_to_nxd(full, spec)
    assert sorted(ours) == sorted(nxd)
    for rank in spec.ranks:
        assert_same_state(ours[rank], nxd[rank])


@pytest.mark.parametrize("case", sorted(CASES))
def test_nxd_converter_output_merges_to_hf_model(case, config, full):
    spec = LayoutSpec.from_hf_config(config, **CASES[case])
    nxd = load_rank_files(ROOT / case / "model", spec)
    assert_same_state(nxd_to_full_state(nxd, spec, verify_replicas=True), full)
    # one tensor at a time gives the same
    name = "model.layers.3.self_attn.q_proj.weight"
    assert bit_equal(rank_shards_to_full(name, nxd, spec), full[name])


@pytest.mark.parametrize("case", sorted(CASES))
def test_trn2_equals_trn1_without_kv_replication(case, config, full):
    """With kv_size_multiplier 1 and tp | kv_heads there is no replication: trn1 and trn2 layouts coincide."""
    spec = LayoutSpec.from_hf_config(config, **{**CASES[case], "hw": "trn2"})
    nxd = load_rank_files(ROOT / case / "model", spec)
    ours = full_state_to_nxd(full, spec)
    for rank in spec.ranks:
        assert_same_state(ours[rank], nxd[rank])


def test_readme_head_table(config):
    """README: tp rank 0 holds q heads [0..3] with kv head 0, tp rank 1 holds [4..7] with kv head 1."""
    spec = LayoutSpec.from_hf_config(config, **CASES["nxd_from_full_tp2_qkvlinear"])
    assert [q_heads_of_rank(spec, r) for r in range(2)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [kv_heads_of_rank(spec, r) for r in range(2)] == [(0,), (1,)]


def test_pipeline_placement_matches_fixture(config):
    """README: pp 0 has layers 0-1 and embed_tokens; pp 1 has layers 2-3, norm and lm_head."""
    spec = LayoutSpec.from_hf_config(config, **CASES["nxd_from_full_tp2_pp2"])
    nxd = load_rank_files(ROOT / "nxd_from_full_tp2_pp2" / "model", spec)
    for tp in range(2):
        pp0, pp1 = set(nxd[(tp, 0)]), set(nxd[(tp, 1)])
        assert "model.embed_tokens.weight" in pp0 and "model.embed_tokens.weight" not in pp1
        assert {"lm_head.weight", "model.norm.weight"} <= pp1 - pp0
        assert {int(k.split(".")[2]) for k in pp0 if k.startswith("model.layers.")} == {0, 1}
        assert {int(k.split(".")[2]) for k in pp1 if k.startswith("model.layers.")} == {2, 3}


@pytest.mark.parametrize(
    "flags,match",
    [
        (dict(tp=2, pp=1), r"layers \[2, 3\] are missing"),  # pp2 files read as pp1
        (dict(tp=2, pp=2, qkv_linear=True), "not expected|missing"),  # wrong naming flag
    ],
)
def test_wrong_flags_are_reported(flags, match, config):
    spec_files = LayoutSpec.from_hf_config(config, **CASES["nxd_from_full_tp2_pp2"])
    nxd = load_rank_files(ROOT / "nxd_from_full_tp2_pp2" / "model", spec_files)
    wrong = LayoutSpec.from_hf_config(config, **flags)
    metas = {r: {k: TensorMeta.of(v) for k, v in sd.items()} for r, sd in nxd.items() if r in wrong.ranks}
    with pytest.raises(LayoutError, match=match):
        plan_nxd_to_full(wrong, metas)


def test_zero1_optimizer_fixture_merges_to_full_moments(config):
    """ZeRO-1 shards (dp=2) -> TP-local moments -> full moments == optimizer_full.safetensors; and back."""
    step = ROOT / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
    spec = LayoutSpec.from_hf_config(config, tp=2, hw="trn1", qkv_linear=True, dp=2)
    truth = load_file(ROOT / "optimizer_full.safetensors")
    model = load_rank_files(step / "model", spec)
    moments: dict[str, dict[tuple[int, int], dict[str, torch.Tensor]]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for rank in spec.ranks:
        tp, pp = rank
        files = [
            step / "optim" / f"dp_rank_{d:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt" for d in range(spec.dp)
        ]
        dp_states = [torch.load(f, weights_only=True) for f in files]
        names = list(model[rank])  # pid = position in the rank's model state dict
        merged = merge_zero1_optimizer(dp_states, names, where=str(files[0]))
        assert list(merged["state"]) == names
        for name in names:
            assert float(merged["state"][name]["step"]) == 3.0
            for key in moments:
                assert merged["state"][name][key].shape == model[rank][name].shape
                moments[key].setdefault(rank, {})[name] = merged["state"][name][key]
        shapes = {n: tuple(t.shape) for n, t in model[rank].items()}
        for d, again in enumerate(shard_zero1_optimizer(merged, shapes, spec.dp)):
            # resharding reproduces every DP file's tensors
            for pid, entry in dp_states[d]["base_state"].items():
                for key, value in entry.items():
                    assert bit_equal(again["base_state"][pid][key], value)
    for key, shards in moments.items():
        full = nxd_to_full_state(shards, spec, verify_replicas=True)
        want = {k: v for k, v in truth.items() if k.endswith(f".{key}")}
        assert_same_state({f"{k}.{key}": v for k, v in full.items()}, want)
