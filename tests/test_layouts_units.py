"""Unit tests of the layout rules against facts read in NxD 0.18's sources (see docs/layouts.md)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.errors import LayoutError
from ckpt.layouts import LayoutSpec, ModelDims, hf_to_nxd_name, nxd_to_hf_names, zero1
from ckpt.layouts import tp as tpmod
from ckpt.layouts.families import get_rule_set
from ckpt.layouts.gqa import kv_heads_of_rank, kv_share_groups, q_heads_of_rank
from ckpt.layouts.pipeline import layer_pp_rank, layers_of_pp_rank, pp_ranks_of, stage_layer_counts
from ckpt.layouts.rules import Kind, rule_for


def dims(heads=8, kv=2, layers=4, **kw) -> ModelDims:
    base = dict(hidden=64, heads=heads, kv_heads=kv, head_dim=8, layers=layers, vocab=256, intermediate=96)
    return ModelDims(**{**base, **kw})


# ------------------------------------------------------------------------------------------ pipeline


def test_stage_split_remainder_on_later_stages():
    assert stage_layer_counts(4, 2) == (2, 2)
    assert stage_layer_counts(5, 2) == (2, 3)
    assert stage_layer_counts(10, 4) == (2, 2, 3, 3)
    with pytest.raises(LayoutError):
        stage_layer_counts(3, 4)


def test_virtual_pp_stage_s_on_rank_s_mod_pp():
    spec = LayoutSpec(model=dims(layers=8), pp=2, virtual_pp=2)
    assert [layer_pp_rank(i, spec) for i in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert layers_of_pp_rank(spec, 0) == (0, 1, 4, 5)
    spec = LayoutSpec(model=dims(layers=7), pp=2, virtual_pp=2)  # stages 1,2,2,2 layers
    assert [layer_pp_rank(i, spec) for i in range(7)] == [0, 1, 1, 0, 0, 1, 1]


def test_pp_placement_of_non_layer_tensors():
    spec = LayoutSpec(model=dims(), pp=3)
    assert pp_ranks_of("model.embed_tokens.weight", spec) == (0,)
    assert pp_ranks_of("model.norm.weight", spec) == (2,)
    assert pp_ranks_of("lm_head.weight", spec) == (2,)
    assert pp_ranks_of("model.rotary_emb.inv_freq", spec) == (0, 1, 2)
    assert pp_ranks_of("model.layers.3.mlp.gate_up_proj.weight", spec) == (2,)  # names keep global index


# ------------------------------------------------------------------------------------------ GQA head order


def test_trn1_q_order_matches_nxd_converter_docstring():
    """checkpoint_converter.py: heads=64, kv=16, m=4, trn1: KV (K0..K15) x4, Q order Q0,Q4,..,Q60,Q1,Q5,.."""
    spec = LayoutSpec(
        model=dims(heads=64, kv=16, hidden=512, vocab=1024, intermediate=1024),
        tp=64,
        qkv_linear=True,
        kv_size_multiplier=4,
        hw="trn1",
    )
    assert [kv_heads_of_rank(spec, r)[0] for r in range(64)] == list(range(16)) * 4
    q = [q_heads_of_rank(spec, r)[0] for r in range(64)]
    assert q[:16] == list(range(0, 64, 4)) and q[16:32] == list(range(1, 64, 4))


def test_trn2_keeps_q_contiguous_and_interleaves_kv():
    """trn2: KV (K0 K0 K0 K0)(K1 ..) (repeat_interleave), Q contiguous Q0,Q1,..."""
    spec = LayoutSpec(
        model=dims(heads=64, kv=16, hidden=512, vocab=1024, intermediate=1024),
        tp=64,
        qkv_linear=True,
        kv_size_multiplier=4,
        hw="trn2",
    )
    assert [kv_heads_of_rank(spec, r)[0] for r in range(64)] == [h for h in range(16) for _ in range(4)]
    assert [q_heads_of_rank(spec, r)[0] for r in range(64)] == list(range(64))


@pytest.mark.parametrize(
    "hw,kv,mult,tp",
    [("trn1", 2, 2, 4), ("trn1", 8, 4, 32), ("trn1", 4, 2, 8), ("trn1", 4, 2, 4), ("trn1", 16, 8, 128)]
    + [("trn2", 2, 2, 4), ("trn2", 8, 4, 32), ("trn2", 4, 2, 8), ("trn2", 16, 8, 128)],
)
def test_kv_copies_live_in_nxd_kv_shared_groups(hw, kv, mult, tp):
    """Replicas of a KV head must sit on one of NxD's kv-shared groups (parallel_state.arrange_kv_groups):
    trn2 groups are adjacent ranks; trn1 groups are ranks j, j + tp/m, j + 2tp/m, ..."""
    spec = LayoutSpec(
        model=dims(heads=kv * mult * 2, kv=kv, vocab=1024, intermediate=1024),
        tp=tp,
        qkv_linear=True,
        kv_size_multiplier=mult,
        hw=hw,
    )
    if hw == "trn2":
        nxd_groups = [tuple(range(k * mult, (k + 1) * mult)) for k in range(tp // mult)]
    else:
        nxd_groups = [tuple(range(j, tp, tp // mult)) for j in range(tp // mult)]
    assert sorted(kv_share_groups(spec)) == sorted(nxd_groups)


# ------------------------------------------------------------------------------------------ names and rules


@pytest.mark.parametrize(
    "flags,q,qkv_bias",
    [
        (dict(), "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.bias"),
        (
            dict(qkv_linear=True),
            "model.layers.1.self_attn.qkv_proj.weight_q",
            "model.layers.1.self_attn.qkv_proj.bias_q",
        ),
        (
            dict(qkv_linear=True, fuse_qkv=True),
            "model.layers.1.self_attn.qkv_proj.weight_qkv",
            "model.layers.1.self_attn.qkv_proj.bias_qkv",
        ),
    ],
)
def test_names(flags, q, qkv_bias):
    spec = LayoutSpec(model=dims(model_type="qwen2"), tp=2, **flags)
    assert hf_to_nxd_name("model.layers.1.self_attn.q_proj.weight", spec) == q
    assert hf_to_nxd_name("model.layers.1.self_attn.q_proj.bias", spec) == qkv_bias
    assert "model.layers.1.self_attn.q_proj.weight" in nxd_to_hf_names(q)
    assert (
        hf_to_nxd_name("model.layers.1.mlp.up_proj.weight", spec) == "model.layers.1.mlp.gate_up_proj.weight"
    )
    assert nxd_to_hf_names("model.layers.1.mlp.gate_up_proj.weight") == (
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
    )
    assert (
        hf_to_nxd_name("model.layers.1.self_attn.o_proj.weight", spec)
        == "model.layers.1.self_attn.o_proj.weight"
    )


def test_mha_fused_name_is_stride3_qkv_proj():
    spec = LayoutSpec(model=dims(heads=8, kv=8), tp=2, fuse_qkv=True)
    assert (
        hf_to_nxd_name("model.layers.0.self_attn.v_proj.weight", spec)
        == "model.layers.0.self_attn.qkv_proj.weight"
    )


def test_rules():
    rules = get_rule_set("nxd-llama")
    assert rule_for("model.embed_tokens.weight", rules).kind is Kind.VOCAB
    assert rule_for("model.layers.0.self_attn.o_proj.weight", rules).partition_dim == 1
    assert rule_for("model.layers.0.self_attn.o_proj.bias", rules).kind is Kind.REPLICATED  # RowParallel bias
    assert rule_for("model.layers.0.mlp.gate_proj.weight", rules).stride == 2
    assert rule_for("model.layers.0.input_layernorm.weight", rules).partition_dim is None
    with pytest.raises(LayoutError, match="unknown layout rule set"):
        get_rule_set("megatron")


# ------------------------------------------------------------------------------------------ TP stride


def test_stride_matches_create_local_weight_definition():
    """NxD: split(full, per_partition/stride) then take [rank::tp] and concatenate."""
    full = torch.arange(24).reshape(12, 2)
    for stride in (1, 2, 3):
        for rank in range(2):
            nxd = torch.cat(torch.split(full, 12 // 2 // stride, dim=0)[rank::2], dim=0)
            assert torch.equal(tpmod.split(full, 0, 2, rank, stride), nxd)
        assert torch.equal(
            tpmod.merge([tpmod.split(full, 0, 2, r, stride) for r in range(2)], 0, stride), full
        )


# ------------------------------------------------------------------------------------------ ZeRO-1


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 11), cols=st.integers(0, 3), dp=st.integers(1, 5))
def test_zero1_shard_unshard(rows, cols, dp):
    shape = (rows, cols) if cols else (rows,)
    t = torch.randn(shape)
    shards = [zero1.shard(t, dp, d) for d in range(dp)]
    assert len({s.shape for s in shards}) == 1
    assert shards[0].shape[0] * dp == zero1.padded_dim0(rows, dp) < rows + dp
    assert torch.equal(zero1.unshard(shards, shape), t)
    for d, s in enumerate(shards):
        start, real, chunk = zero1.shard_rows(rows, dp, d)
        assert chunk == s.shape[0]
        assert torch.equal(s[:real], t[start : start + real])
        assert not s[real:].any()  # padding rows are zeros


def test_zero1_unshard_refuses_shards_of_another_shape():
    shards = zero1.shard_all(torch.randn(5, 3), 2)
    with pytest.raises(LayoutError, match="do not make shape"):
        zero1.unshard(shards, (7, 3))
    with pytest.raises(LayoutError, match="do not make shape"):
        zero1.unshard(shards[:1], (5, 3))


# ------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "model,flags,message",
    [
        (dims(heads=8, kv=8), dict(tp=3), "--tp 3 does not divide vocab_size=256"),
        (
            dims(vocab=240, heads=12, kv=4),
            dict(tp=3, qkv_linear=True, kv_size_multiplier=2),
            "--tp 3 does not divide num_key_value_heads\\*kv_size_multiplier=8",
        ),
        (
            dims(),
            dict(tp=4),
            "--tp 4 does not divide num_key_value_heads=2; use --qkv-linear with --kv-size-multiplier 2",
        ),
        (dims(), dict(tp=2, kv_size_multiplier=2), "--kv-size-multiplier 2 needs --qkv-linear"),
        (dims(), dict(tp=2, fuse_qkv=True), "--fuse-qkv with GQA"),
        (
            dims(),
            dict(tp=2, hw="trn2", qkv_linear=True, kv_size_multiplier=2),
            "--hw trn2 with --kv-size-multiplier 2",
        ),
        (
            dims(),
            dict(tp=8, qkv_linear=True, kv_size_multiplier=8),
            "--kv-size-multiplier 8 does not divide num_attention_heads/num_key_value_heads=4",
        ),
        (dims(), dict(pp=3, virtual_pp=2), "6 stages exceed num_hidden_layers=4"),
        (dims(model_type="gpt2"), dict(), "model_type 'gpt2'"),
        (dims(), dict(hw="trn3"), "--hw 'trn3'"),
        (dims(), dict(tp=0), "--tp 0"),
    ],
)
def test_impossible_specs_fail_early(model, flags, message):
    with pytest.raises(LayoutError, match=message):
        LayoutSpec(model=model, **flags)


def test_from_hf_config_reads_dims_and_reports_missing_keys():
    cfg = {
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "vocab_size": 256,
        "intermediate_size": 96,
        "model_type": "mistral",
    }
    spec = LayoutSpec.from_hf_config(cfg, tp=2)
    assert spec.model.head_dim == 8 and spec.model.model_type == "mistral"
    with pytest.raises(LayoutError, match="'vocab_size'"):
        LayoutSpec.from_hf_config({k: v for k, v in cfg.items() if k != "vocab_size"})


def test_shape_contradicting_config_is_reported():
    from ckpt.layouts import TensorMeta, plan_full_to_nxd

    spec = LayoutSpec(model=dims(), tp=2)
    with pytest.raises(
        LayoutError, match=r"q_proj.weight has shape \[32, 64\] but the config implies \[64, 64\]"
    ):
        plan_full_to_nxd(
            spec, {"model.layers.0.self_attn.q_proj.weight": TensorMeta((32, 64), torch.float32)}
        )
    with pytest.raises(LayoutError, match="gate_proj.weight is missing"):
        plan_full_to_nxd(spec, {"model.layers.0.mlp.up_proj.weight": TensorMeta((96, 64), torch.float32)})


@pytest.mark.parametrize("model_type, tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_hf_shapes_match_a_real_transformers_model(model_type: str, tie: bool) -> None:
    """ModelDims.hf_shapes lists exactly the tensors (names, shapes, order) of the real HF model."""
    import transformers

    cfg = {
        "model_type": model_type, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 40, "intermediate_size": 24, "tie_word_embeddings": tie,
    }  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if tie:
        expected.pop("lm_head.weight", None)
    got = ModelDims.from_hf_config(cfg).hf_shapes(qkv_bias=model_type == "qwen2")
    assert (
        list(got.items()) == [(n, s) for n, s in expected.items() if n in got]
        and got.keys() == expected.keys()
    )
