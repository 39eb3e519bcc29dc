"""Property tests: full -> NxD rank shards -> full is bit-exact for every valid layout, and the shards have
the structure NxD expects (PP placement, per-rank shapes, Q heads next to their own KV head)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt.layouts import (
    LayoutSpec,
    ModelDims,
    bit_equal,
    full_state_to_nxd,
    fusion_group,
    nxd_to_full_state,
    rank_shards_to_full,
)
from ckpt.layouts.pipeline import layer_pp_rank, stage_layer_counts

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def specs(draw) -> LayoutSpec:
    kv = draw(st.integers(1, 4))
    qkv_linear = draw(st.booleans())
    mult = draw(st.sampled_from([1, 2, 4])) if qkv_linear else 1
    group = mult * draw(st.integers(1, 3))
    heads = kv * group
    hw = draw(st.sampled_from(["trn1", "trn2"]))
    if not qkv_linear:
        tp = draw(st.sampled_from([d for d in range(1, kv + 1) if kv % d == 0]))
    elif hw == "trn2" and mult > 1:
        tp = kv * mult
    else:
        tp = draw(st.sampled_from([d for d in range(mult, kv * mult + 1, mult) if (kv * mult) % d == 0]))
    fuse = draw(st.booleans()) if (qkv_linear or heads == kv) else False
    layers = draw(st.integers(1, 5))
    pp = draw(st.integers(1, layers))
    vpp = draw(st.integers(1, layers // pp))
    dims = ModelDims(
        hidden=draw(st.sampled_from([4, 6, 8])),
        heads=heads,
        kv_heads=kv,
        head_dim=draw(st.sampled_from([2, 4])),
        layers=layers,
        vocab=tp * draw(st.integers(1, 4)),
        intermediate=tp * draw(st.integers(1, 3)),
        model_type=draw(st.sampled_from(["llama", "mistral", "qwen2"])),
    )
    return LayoutSpec(
        model=dims,
        tp=tp,
        pp=pp,
        virtual_pp=vpp,
        kv_size_multiplier=mult,
        hw=hw,
        fuse_qkv=fuse,
        qkv_linear=qkv_linear,
    )


def make_state(
    spec: LayoutSpec, dtype: torch.dtype, seed: int, extra_buffer: bool
) -> dict[str, torch.Tensor]:
    """A random HF-named state dict with the spec's shapes (q/k/v biases for Qwen2 style models)."""
    m = spec.model
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (m.vocab, m.hidden)}
    if extra_buffer:
        shapes["model.rotary_emb.inv_freq"] = (m.head_dim // 2,)
    for i in range(m.layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.self_attn.q_proj.weight"] = (m.q_rows, m.hidden)
        shapes[f"{p}.self_attn.k_proj.weight"] = (m.kv_rows, m.hidden)
        shapes[f"{p}.self_attn.v_proj.weight"] = (m.kv_rows, m.hidden)
        if m.model_type == "qwen2":
            shapes[f"{p}.self_attn.q_proj.bias"] = (m.q_rows,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (m.kv_rows,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (m.kv_rows,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (m.hidden, m.q_rows)
        shapes[f"{p}.mlp.gate_proj.weight"] = (m.intermediate, m.hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (m.intermediate, m.hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (m.hidden, m.intermediate)
        shapes[f"{p}.input_layernorm.weight"] = (m.hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (m.hidden,)
    shapes["model.norm.weight"] = (m.hidden,)
    shapes["lm_head.weight"] = (m.vocab, m.hidden)
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), extra=st.booleans())
def test_roundtrip_bit_exact(spec, dtype, seed, extra):
    state = make_state(spec, dtype, seed, extra)
    shards = full_state_to_nxd(state, spec)
    assert sorted(shards) == sorted(spec.ranks)
    back = nxd_to_full_state(shards, spec, verify_replicas=True)
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert bit_equal(back[name], tensor), name
    # per-tensor merge agrees with the whole-state merge
    name = "model.layers.0.self_attn.k_proj.weight"
    assert bit_equal(rank_shards_to_full(name, shards, spec, verify_replicas=True), state[name])
    # shards are fresh tensors, not views into the full ones
    for rank_sd in shards.values():
        for t in rank_sd.values():
            assert all(
                t.untyped_storage().data_ptr() != s.untyped_storage().data_ptr() for s in state.values()
            )
            assert t.dtype == dtype


@settings(max_examples=150, deadline=None)
@given(spec=specs())
def test_shard_structure(spec):
    m = spec.model
    state = make_state(spec, torch.float32, 0, extra_buffer=True)
    shards = full_state_to_nxd(state, spec)
    last = spec.pp - 1
    for (_tp, pp), sd in shards.items():
        assert ("model.embed_tokens.weight" in sd) == (pp == 0)
        assert ("lm_head.weight" in sd) == (pp == last)
        assert ("model.norm.weight" in sd) == (pp == last)
        assert "model.rotary_emb.inv_freq" in sd  # other non-layer tensors: every PP rank
        assert sd["model.embed_tokens.weight"].shape[0] == m.vocab // spec.tp if pp == 0 else True
        layers = {int(k.split(".")[2]) for k in sd if k.startswith("model.layers.")}
        assert layers == {i for i in range(m.layers) if layer_pp_rank(i, spec) == pp}
        for i in layers:
            p = f"model.layers.{i}"
            assert sd[f"{p}.mlp.gate_up_proj.weight"].shape == (2 * m.intermediate // spec.tp, m.hidden)
            assert sd[f"{p}.mlp.down_proj.weight"].shape == (m.hidden, m.intermediate // spec.tp)
            assert sd[f"{p}.self_attn.o_proj.weight"].shape == (m.hidden, m.q_rows // spec.tp)
            q_rows, kv_rows = m.q_rows // spec.tp, spec.kv_slots * m.head_dim // spec.tp
            if spec.qkv_linear and spec.fuse_qkv:
                assert sd[f"{p}.self_attn.qkv_proj.weight_qkv"].shape == (q_rows + 2 * kv_rows, m.hidden)
            elif spec.qkv_linear:
                assert sd[f"{p}.self_attn.qkv_proj.weight_k"].shape == (kv_rows, m.hidden)
            elif spec.fuse_qkv:
                assert sd[f"{p}.self_attn.qkv_proj.weight"].shape == (q_rows + 2 * kv_rows, m.hidden)
            else:
                assert sd[f"{p}.self_attn.k_proj.weight"].shape == (kv_rows, m.hidden)
    counts = stage_layer_counts(m.layers, spec.num_stages)
    assert sum(counts) == m.layers and max(counts) - min(counts) <= 1 and list(counts) == sorted(counts)


def _local_qkv(sd: dict[str, torch.Tensor], spec: LayoutSpec) -> tuple[torch.Tensor, torch.Tensor]:
    m, p = spec.model, "model.layers.0.self_attn"
    q_rows, kv_rows = m.q_rows // spec.tp, spec.kv_slots * m.head_dim // spec.tp
    if spec.qkv_linear and not spec.fuse_qkv:
        return sd[f"{p}.qkv_proj.weight_q"], sd[f"{p}.qkv_proj.weight_k"]
    if spec.fuse_qkv:
        fused = sd[f"{p}.qkv_proj.weight_qkv" if spec.qkv_linear else f"{p}.qkv_proj.weight"]
        return fused[:q_rows], fused[q_rows : q_rows + kv_rows]
    return sd[f"{p}.q_proj.weight"], sd[f"{p}.k_proj.weight"]


@settings(max_examples=200, deadline=None)
@given(spec=specs())
def test_every_rank_pairs_q_heads_with_their_own_kv_head(spec):
    """Label each HF head's rows with its index; on each rank, local q head a must meet (via NxD's in-rank
    repeat_kv, slot a // (n_q/n_kv)) the KV head h // (heads/kv_heads) of its HF index h; and every HF query
    head is held exactly once."""
    m = spec.model
    state = make_state(spec, torch.float32, 0, extra_buffer=False)
    p = "model.layers.0.self_attn"
    state[f"{p}.q_proj.weight"] = (
        torch.arange(m.heads).repeat_interleave(m.head_dim)[:, None].expand(-1, m.hidden).float()
    )
    state[f"{p}.k_proj.weight"] = (
        torch.arange(m.kv_heads).repeat_interleave(m.head_dim)[:, None].expand(-1, m.hidden).float()
    )
    shards = full_state_to_nxd(state, spec)
    pp0 = layer_pp_rank(0, spec)
    n_q, n_kv = m.heads // spec.tp, spec.kv_slots // spec.tp
    seen = []
    for tp in range(spec.tp):
        q, k = _local_qkv(shards[(tp, pp0)], spec)
        q_heads = q[:: m.head_dim, 0].long().tolist()
        kv_heads = k[:: m.head_dim, 0].long().tolist()
        assert len(q_heads) == n_q and len(kv_heads) == n_kv
        for a, h in enumerate(q_heads):
            assert kv_heads[a // (n_q // n_kv)] == h // (m.heads // m.kv_heads), (tp, a, h)
        seen += q_heads
    assert sorted(seen) == list(range(m.heads))


@settings(max_examples=50, deadline=None)
@given(spec=specs())
def test_fusion_groups_convert_alone(spec):
    """A streaming converter can load one fusion group at a time and get the same tensors."""
    state = make_state(spec, torch.float32, 1, extra_buffer=False)
    whole = full_state_to_nxd(state, spec)
    from ckpt.layouts import full_to_rank_shards

    done: set[str] = set()
    for name in state:
        if name in done:
            continue
        group = fusion_group(name, spec)
        done.update(group)
        part = full_to_rank_shards({g: state[g] for g in group}, spec)
        for rank, sd in part.items():
            for nxd_name, t in sd.items():
                assert bit_equal(t, whole[rank][nxd_name])
