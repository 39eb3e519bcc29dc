"""Ground truth from NxD's own layers (fixtures/nxd_layers, made by running NxD 2.29's unmodified parallel layers on
CPU gloo ranks; see its README): ckpt's HF -> NxD layout equals what NxD's layers hold, rank by rank, and NxD -> HF of
NxD's own per-rank state gives the HF truth back, for Llama, Qwen3 (head_dim 12 != hidden/heads) and Mixtral with
expert parallelism.  NxD's MoE forward on those shards equals the HF experts.  Where NxD's layers' *initialisation*
is not a load path (KV replication, kv_size_multiplier > 1), the fixtures pin exactly how it differs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpt.layouts import LayoutSpec
from ckpt.layouts.experts import full_state_to_nxd_ep, nxd_ep_to_full_state

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nxd_layers"
CASES = {
    "llama_tp2_trn1_m1": dict(tp=2, qkv_linear=True),
    "qwen3_tp2_trn1_m1": dict(tp=2, qkv_linear=True),
    "mixtral_tp2_ep2": dict(tp=2, qkv_linear=True, ep=2),
}
REPLICATED = ("layernorm.weight", "model.norm.weight", "q_norm.weight", "k_norm.weight")


def load(case: str, flags: dict):
    d = FIX / case
    cfg = json.loads((d / "hf" / "config.json").read_text())
    hf = load_file(str(d / "hf" / "model.safetensors"))
    spec = LayoutSpec.from_hf_config(cfg, **flags)
    nxd = {}
    for t in range(spec.tp):
        for e in range(spec.ep):
            nxd[(t, 0, e)] = load_file(str(d / f"rank_tp{t}_ep{e}.safetensors"))
    return cfg, hf, spec, nxd


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_nxd_equals_nxd_layers_rank_by_rank(case):
    _, hf, spec, nxd = load(case, CASES[case])
    ours = full_state_to_nxd_ep(hf, spec)
    assert ours.keys() == nxd.keys()
    for rank, theirs in nxd.items():
        mine = ours[rank]
        # NxD's layers hold every parallel tensor; the norms (plain HF modules in NxD's models) are ckpt's extra
        assert {n for n in mine if not n.endswith(REPLICATED)} == set(theirs), rank
        for name, t in theirs.items():
            assert torch.equal(mine[name], t), (rank, name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_nxd_layers_state_to_hf_equals_truth(case):
    _, hf, spec, nxd = load(case, CASES[case])
    norms = {n: t for n, t in hf.items() if n.endswith(REPLICATED)}
    shards = {rank: {**sd, **norms} for rank, sd in nxd.items()}
    back = nxd_ep_to_full_state(shards, spec, verify_replicas=True)
    assert back.keys() == hf.keys()
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_nxd_experts_forward_on_these_shards_is_the_hf_experts():
    """NxD's Experts.forward (fixture output) on the shards ckpt reproduces bit for bit equals each HF expert."""
    cfg, hf, spec, _ = load("mixtral_tp2_ep2", CASES["mixtral_tp2_ep2"])
    per = cfg["num_local_experts"] // 2
    for k in range(2):
        f = load_file(str(FIX / "mixtral_tp2_ep2" / f"experts_forward_ep{k}.safetensors"))
        x = f["input"][0].double()
        for slot in range(per):
            j = k * per + slot
            e = f"model.layers.0.block_sparse_moe.experts.{j}."
            g, u, d = (hf[e + w].double() for w in ("w1.weight", "w3.weight", "w2.weight"))
            want = (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T
            torch.testing.assert_close(f["output"][slot].double(), want, rtol=1e-5, atol=1e-6)


def test_nxd_layer_init_with_kv_multiplier_is_not_a_load_path():
    """With kv_size_multiplier 2, NxD's GQAQKVColumnParallelLinear *initialisation* from a master weight splits Q
    contiguously and tiles K/V (trn1), or repeat_interleaves K/V *rows*, not heads (trn2).  Either pairs query heads
    with the wrong KV rows, which is harmless for a random init but not a way to load HF weights; ckpt instead keeps
    each Q head next to a copy of its own KV head (proven by logits in test_layouts_functional.py)."""
    cfg, hf, spec, nxd = load(
        "qwen3_tp2_trn1_m2", dict(tp=2, qkv_linear=True, kv_size_multiplier=2, hw="trn1")
    )
    a = "model.layers.0.self_attn."
    q, k = hf[a + "q_proj.weight"], hf[a + "k_proj.weight"]
    hd = cfg["head_dim"]
    ours = full_state_to_nxd_ep(hf, spec)
    for t in range(2):
        theirs = nxd[(t, 0, 0)]
        assert torch.equal(
            theirs[a + "qkv_proj.weight_q"], q[t * 2 * hd : (t + 1) * 2 * hd]
        )  # heads 2t, 2t+1
        assert torch.equal(theirs[a + "qkv_proj.weight_k"], k)  # slots (K0 K1)(K0 K1): rank t holds K0, K1
        assert torch.equal(ours[(t, 0, 0)][a + "qkv_proj.weight_k"], k)  # the same K slots in ckpt
        # ckpt pairs local Q head i with local slot i: Q heads t, t+2 (K0's copy t, K1's copy t)
        want_q = torch.cat([q[t * hd : (t + 1) * hd], q[(t + 2) * hd : (t + 3) * hd]])
        assert torch.equal(ours[(t, 0, 0)][a + "qkv_proj.weight_q"], want_q)
    cfg, hf, spec, nxd = load(
        "qwen3_mqa_tp2_trn2_m2", dict(tp=2, qkv_linear=True, kv_size_multiplier=2, hw="trn2")
    )
    k = hf[a + "k_proj.weight"]  # one KV head of 12 rows
    for t in range(2):
        rows = k.repeat_interleave(2, dim=0)[t * 12 : (t + 1) * 12]  # NxD: every row twice, then split
        assert torch.equal(nxd[(t, 0, 0)][a + "qkv_proj.weight_k"], rows)
        assert torch.equal(
            full_state_to_nxd_ep(hf, spec)[(t, 0, 0)][a + "qkv_proj.weight_k"], k
        )  # ckpt: K0 whole
