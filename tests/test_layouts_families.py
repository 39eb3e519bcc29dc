"""Model families as data (ckpt/layouts/families/): every family's HF tensors are covered by explicit rules, real
``transformers`` models have exactly the tensors the family lists, and each family converts HF -> NxD -> HF exactly,
including Qwen3 (q_norm/k_norm, head_dim != hidden/heads), Qwen2 biases and MoE experts with expert parallelism."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from ckpt.errors import LayoutError
from ckpt.layouts import LayoutSpec, ModelDims, full_state_to_nxd
from ckpt.layouts.experts import full_state_to_nxd_ep, nxd_ep_to_full_state
from ckpt.layouts.families import FAMILIES, RULE_SETS, get_family, supported
from ckpt.layouts.partition import nxd_partition
from ckpt.layouts.rules import Kind

transformers = pytest.importorskip("transformers")

BASE = {
    "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "vocab_size": 48, "intermediate_size": 24, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
}  # fmt: skip
CONFIGS = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 12},  # heads*head_dim = 48 != hidden 32
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"head_dim": 12, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
}


def config(model_type: str, **kw) -> dict:
    return {"model_type": model_type, **BASE, **CONFIGS[model_type], **kw}


_MODELS: dict[str, tuple] = {}


def hf_model(cfg: dict, tmp_path):
    """A real transformers model saved with ``save_pretrained`` (the Hub's on-disk names); its state and dir.  Built
    once per config for the whole module (tests only read it; the first test's ``tmp_path`` holds the files)."""
    key = json.dumps(cfg, sort_keys=True)
    if key not in _MODELS:
        torch.manual_seed(0)
        hf_cfg = transformers.AutoConfig.for_model(**cfg)
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
        with torch.no_grad():
            for p in model.parameters():  # norms away from 1 so a misplaced norm shows
                p.add_(torch.randn_like(p) * 0.05)
        out = tmp_path / cfg["model_type"]
        model.save_pretrained(out)
        _MODELS[key] = (model, load_file(str(out / "model.safetensors")), out)
    return _MODELS[key]


def test_registry_lists_every_family_and_refuses_unknown_ones():
    assert supported() == ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")
    assert {f.rule_set for f in FAMILIES.values()} == set(RULE_SETS)
    assert get_family("qwen2").rules is get_family("llama").rules  # nxd-llama is one rule set
    with pytest.raises(
        LayoutError, match=r"model_type 'gpt2' is not supported \(supported: llama, mistral, mixtral"
    ):
        LayoutSpec.from_hf_config({**BASE, "model_type": "gpt2"})
    with pytest.raises(LayoutError, match="model_type 'deepseek_v3' is not supported"):
        ModelDims.from_hf_config({**BASE, "model_type": "deepseek_v3"}).hf_shapes()


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_family_lists_exactly_the_real_models_tensors_and_rules_cover_all(model_type, tmp_path):
    cfg = config(model_type)
    _, state, _ = hf_model(cfg, tmp_path)
    got = ModelDims.from_hf_config(cfg).hf_shapes()
    assert {n: tuple(t.shape) for n, t in state.items()} == got
    family = get_family(model_type)
    for name in got:  # an explicit rule for every tensor, replicated ones included
        assert any(r.matches(name) for r in family.rules), name


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
@pytest.mark.parametrize(
    "flags",
    [
        dict(tp=2),
        dict(tp=2, pp=2, qkv_linear=True, kv_size_multiplier=2),
        dict(tp=4, qkv_linear=True, kv_size_multiplier=2, hw="trn2", fuse_qkv=True),
    ],
)
def test_hf_to_nxd_to_hf_is_exact(model_type, flags, tmp_path):
    cfg = config(model_type)
    _, state, _ = hf_model(cfg, tmp_path)
    ep = 2 if get_family(model_type).experts else 1
    spec = LayoutSpec.from_hf_config(cfg, ep=ep, **flags)
    shards = full_state_to_nxd_ep(state, spec)
    assert len(shards) == spec.tp * spec.pp * ep
    back = nxd_ep_to_full_state(shards, spec, verify_replicas=True)
    assert back.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(back[name], t), name


def test_qwen3_head_dim_and_qk_norm_layout(tmp_path):
    """Q rows are heads*head_dim (48), not hidden (32); q_norm/k_norm are whole on every rank."""
    cfg = config("qwen3")
    _, state, _ = hf_model(cfg, tmp_path)
    spec = LayoutSpec.from_hf_config(cfg, tp=2, qkv_linear=True, kv_size_multiplier=2)
    shards = full_state_to_nxd(state, spec)
    a = "model.layers.0.self_attn."
    for sd in shards.values():
        assert sd[a + "qkv_proj.weight_q"].shape == (2 * 12, 32)
        assert sd[a + "qkv_proj.weight_k"].shape == (2 * 12, 32)  # 2 kv heads x2 copies / tp 2
        assert sd[a + "o_proj.weight"].shape == (32, 2 * 12)
        assert torch.equal(sd[a + "q_norm.weight"], state[a + "q_norm.weight"])
        assert torch.equal(sd[a + "k_norm.weight"], state[a + "k_norm.weight"])
    assert get_family("qwen3").rule_for(a + "k_norm.weight").kind is Kind.REPLICATED
    assert nxd_partition(a + "q_norm.weight", "nxd-qwen3") is None


def test_qwen2_biases_split_like_their_rows(tmp_path):
    cfg = config("qwen2")
    _, state, _ = hf_model(cfg, tmp_path)
    spec = LayoutSpec.from_hf_config(cfg, tp=2, qkv_linear=True, fuse_qkv=True)
    shards = full_state_to_nxd(state, spec)
    a = "model.layers.1.self_attn."
    hd = 8
    for tp in range(2):
        b = shards[(tp, 0)][a + "qkv_proj.bias_qkv"]
        q = state[a + "q_proj.bias"][tp * 2 * hd : (tp + 1) * 2 * hd]
        k = state[a + "k_proj.bias"][tp * hd : (tp + 1) * hd]  # rank r: Q heads 2r, 2r+1 and KV head r
        v = state[a + "v_proj.bias"][tp * hd : (tp + 1) * hd]
        assert torch.equal(b, torch.cat([q, k, v]))


def nxd_local_weight(full: torch.Tensor, dim: int, tp: int, rank: int, stride: int) -> torch.Tensor:
    """NxD 2.29 ``parallel_layers/layers.py::create_local_weight`` (re-stated): cut ``dim`` into ``tp*stride`` chunks,
    keep chunks ``rank::tp``."""
    chunks = torch.split(full, full.shape[dim] // (tp * stride), dim=dim)
    return torch.cat(chunks[rank::tp], dim=dim)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_moe_experts_are_nxd_expert_mlps_layout(model_type, tmp_path):
    """gate_up_proj [E/ep, H, 2I/tp] and down_proj [E/ep, I/tp, H] as NxD's ExpertFused*ParallelLinear build them
    from the stacked master weights (gate_up master = cat[gate^T, up^T] on dim 2, stride 2; down master = down^T
    split on dim 1); EP rank k holds experts [k*E/ep, (k+1)*E/ep); the router is whole everywhere."""
    cfg = config(model_type)
    _, state, _ = hf_model(cfg, tmp_path)
    family = get_family(model_type)
    e = family.experts
    tp, ep, experts = 2, 2, 4
    spec = LayoutSpec.from_hf_config(cfg, tp=tp, ep=ep)
    shards = full_state_to_nxd_ep(state, spec)
    for layer in range(2):
        p = f"model.layers.{layer}."
        gate = torch.stack([state[f"{p}{e.block}experts.{j}.{e.gate}.weight"] for j in range(experts)])
        up = torch.stack([state[f"{p}{e.block}experts.{j}.{e.up}.weight"] for j in range(experts)])
        down = torch.stack([state[f"{p}{e.block}experts.{j}.{e.down}.weight"] for j in range(experts)])
        gate_up_master = torch.cat([gate.transpose(1, 2), up.transpose(1, 2)], dim=2)  # [E, H, 2I]
        down_master = down.transpose(1, 2)  # [E, I, H]
        for (t, _, k), sd in shards.items():
            experts_k = slice(k * experts // ep, (k + 1) * experts // ep)
            gu = sd[f"{p}mlp.expert_mlps.mlp_op.gate_up_proj.weight"]
            dn = sd[f"{p}mlp.expert_mlps.mlp_op.down_proj.weight"]
            assert torch.equal(gu, nxd_local_weight(gate_up_master[experts_k], 2, tp, t, 2))
            assert torch.equal(dn, nxd_local_weight(down_master[experts_k], 1, tp, t, 1))
            assert torch.equal(sd[f"{p}mlp.router.linear_router.weight"], state[f"{p}{e.block}gate.weight"])
    assert nxd_partition("model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight", family.rule_set) == (
        2,
        2,
    )
    assert nxd_partition("model.layers.0.mlp.expert_mlps.mlp_op.down_proj.weight", family.rule_set) == (1, 1)
    assert nxd_partition("model.layers.0.mlp.router.linear_router.weight", family.rule_set) is None


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_moe_expert_forward_on_shards_equals_hf_expert(model_type, tmp_path):
    """NxD's Experts math on each (tp, ep) shard (chunk gate/up, silu(gate)*up, down; sum over TP) gives the HF
    expert's output: the functional proof that gate/up/down pieces line up."""
    cfg = config(model_type)
    model, state, _ = hf_model(cfg, tmp_path)
    spec = LayoutSpec.from_hf_config(cfg, tp=2, ep=2)
    shards = full_state_to_nxd_ep(state, spec)
    e = get_family(model_type).experts
    x = torch.randn(5, 32, dtype=torch.float64)
    p = "model.layers.1."
    for j in range(4):
        g = state[f"{p}{e.block}experts.{j}.{e.gate}.weight"].double()
        u = state[f"{p}{e.block}experts.{j}.{e.up}.weight"].double()
        d = state[f"{p}{e.block}experts.{j}.{e.down}.weight"].double()
        want = (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T
        k, slot = divmod(j, 2)
        got = torch.zeros_like(want)
        for t in range(2):
            sd = shards[(t, 0, k)]
            inter = x @ sd[f"{p}mlp.expert_mlps.mlp_op.gate_up_proj.weight"][slot].double()
            gate, up = torch.chunk(inter, 2, dim=-1)
            got += (torch.nn.functional.silu(gate) * up) @ sd[f"{p}mlp.expert_mlps.mlp_op.down_proj.weight"][
                slot
            ].double()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_hf_export_of_nxd_layout_loads_in_transformers_with_the_same_logits(model_type, tmp_path):
    cfg = config(model_type)
    model, state, src = hf_model(cfg, tmp_path)
    ep = 2 if get_family(model_type).experts else 1
    spec = LayoutSpec.from_hf_config(cfg, tp=2, pp=2, ep=ep, qkv_linear=True, kv_size_multiplier=2)
    back = nxd_ep_to_full_state(full_state_to_nxd_ep(state, spec), spec)
    out = tmp_path / "export"
    out.mkdir()
    from safetensors.torch import save_file

    save_file(
        {n: t.contiguous() for n, t in back.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text((src / "config.json").read_text())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 48, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_unsupported_family_settings_are_refused():
    with pytest.raises(LayoutError, match="tie_word_embeddings with --pp 2"):
        LayoutSpec.from_hf_config(config("llama", tie_word_embeddings=True), pp=2)
    LayoutSpec.from_hf_config(config("llama", tie_word_embeddings=True), tp=2)  # pp 1 is fine
    with pytest.raises(LayoutError, match="--ep 2 needs an MoE model"):
        LayoutSpec.from_hf_config(config("llama"), ep=2)
    with pytest.raises(LayoutError, match="--ep 3 does not divide num_local_experts=4"):
        LayoutSpec.from_hf_config(config("mixtral"), ep=3)
    with pytest.raises(LayoutError, match=r"mlp_only_layers=\[1\]"):
        LayoutSpec.from_hf_config(config("qwen3_moe", mlp_only_layers=[1]))
    with pytest.raises(LayoutError, match="--tp 4 does not divide moe_intermediate_size=18"):
        LayoutSpec.from_hf_config(config("qwen3_moe", moe_intermediate_size=18), tp=4)
    json.dumps(config("qwen3"))  # configs stay plain JSON


@pytest.mark.parametrize(
    "model_type, args, message",
    [
        ("llama", [], "--ep 2 needs an MoE model"),
        ("mixtral", ["--ep", "3"], "--ep 3 does not divide num_local_experts=4"),
    ],
)
def test_cli_ep_flag_is_checked(model_type, args, message, tmp_path):
    """``ckpt convert --ep``: a dense model and an EP size not dividing the experts are refused (exit 2, one line,
    nothing written); tests/test_convert_moe.py and tests/test_nxd_moe.py convert MoE models."""
    from ckpt.cli.main import cli
    from click.testing import CliRunner

    _, _, src = hf_model(config(model_type), tmp_path)
    dst = tmp_path / "out"
    argv = ["convert", str(src), str(dst), "--to", "neuron", "--tp", "2", "--ep", "2", *args]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("ckpt: error:")]  # warnings may precede it
    assert len(errors) == 1 and message in errors[0], r.output
    assert not dst.exists()


@st.composite
def family_specs(draw):
    """Any family, dims and flags the spec accepts (qwen3's head_dim independent of hidden; MoE with EP)."""
    model_type = draw(st.sampled_from(sorted(CONFIGS)))
    family = get_family(model_type)
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    cfg = {
        "model_type": model_type, "hidden_size": draw(st.sampled_from([8, 16])), "num_attention_heads": heads,
        "num_key_value_heads": kv, "num_hidden_layers": draw(st.integers(1, 4)), "vocab_size": 16,
        "intermediate_size": draw(st.sampled_from([4, 8])), "head_dim": draw(st.sampled_from([2, 4, 6])),
        "tie_word_embeddings": draw(st.booleans()),
    }  # fmt: skip
    if family.experts is not None:
        cfg[family.experts.count_keys[0]] = draw(st.sampled_from([2, 4]))
        cfg[family.experts.intermediate_key] = cfg["intermediate_size"]
    flags = dict(
        tp=draw(st.sampled_from([1, 2, 4])), pp=draw(st.sampled_from([1, 2])), virtual_pp=draw(st.sampled_from([1, 2])),
        qkv_linear=draw(st.booleans()), fuse_qkv=draw(st.booleans()), hw=draw(st.sampled_from(["trn1", "trn2"])),
        kv_size_multiplier=draw(st.sampled_from([1, 2, 4])), ep=draw(st.sampled_from([1, 2])) if family.experts else 1,
    )  # fmt: skip
    try:
        spec = LayoutSpec.from_hf_config(cfg, **flags)
    except LayoutError:
        assume(False)
    return spec, draw(st.sampled_from([torch.float32, torch.bfloat16])), draw(st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(case=family_specs(), seed=st.integers(0, 2**16))
def test_any_family_layout_round_trips_bit_exact(case, seed):
    """HF -> NxD (TP/PP/vPP/EP, kv multiplier, trn1/trn2, fused or not) -> HF is bit-exact for every family, and
    every (tp, pp, ep) rank holds exactly the tensors the spec implies (checked by the inverse plan)."""
    spec, dtype, bias = case
    g = torch.Generator().manual_seed(seed)
    shapes = spec.model.hf_shapes(qkv_bias=bias or None)
    state = {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}
    shards = full_state_to_nxd_ep(state, spec)
    assert len(shards) == spec.tp * spec.pp * spec.ep
    back = nxd_ep_to_full_state(shards, spec, verify_replicas=True)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[n].view(torch.uint8), t.view(torch.uint8)) for n, t in state.items())
