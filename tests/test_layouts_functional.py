"""Head pairing, proven by running the model: a tensor-parallel forward computed only from NxD-layout rank
shards, the way NxD's Llama model code computes it, must equal the Hugging Face model's logits.

Per TP rank (NxD ``modeling_llama_nxd.py`` / ``GQAQKVColumnParallelLinear`` semantics): ``heads/tp`` local
query heads, ``kv_heads*kv_size_multiplier/tp`` local KV heads, HF ``repeat_kv`` inside the rank; o_proj and
down_proj are row-parallel (partial sums added over ranks); gate_up_proj is split in half per rank;
embeddings and lm_head are vocab-parallel.  A layout that pairs a query head with the wrong KV head gives
different logits, so this test can fail; ``test_nxd_trn2_repeat_tiling_fails`` shows that it does for the
KV tiling NxD's own converter writes on trn2.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ckpt.errors import LayoutError
from ckpt.layouts import LayoutSpec, full_state_to_nxd, nxd_to_full_state
from ckpt.layouts.fused import local_part_sizes

torch.backends.cuda.matmul.allow_tf32 = False
ATOL = 1e-6  # float64 model (HF RMSNorm rounds through fp32: ~1e-8); a wrong head pairing is ~1e-2


def _model(kind: str, heads: int, kv_heads: int, layers: int = 2, seed: int = 0):
    common = dict(
        hidden_size=32,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=4,
        num_hidden_layers=layers,
        vocab_size=64,
        intermediate_size=48,
        attn_implementation="eager",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model = model.double().eval()
    with torch.no_grad():  # HF inits biases to zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _qkv(sd: dict[str, torch.Tensor], pre: str, spec: LayoutSpec, kind: str):
    """Local q, k, v weights (and biases or None) of one rank, from whichever NxD naming is in use."""
    names = [f"{pre}.{p}_proj.{kind}" for p in "qkv"]
    if spec.qkv_linear and spec.fuse_qkv:
        fused = sd.get(f"{pre}.qkv_proj.{kind}_qkv")
        return None if fused is None else torch.split(fused, list(local_part_sizes(names, spec)))
    if spec.qkv_linear:
        if f"{pre}.qkv_proj.{kind}_q" not in sd:
            return None
        return tuple(sd[f"{pre}.qkv_proj.{kind}_{p}"] for p in "qkv")
    if spec.fuse_qkv:
        fused = sd.get(f"{pre}.qkv_proj.{kind}")
        return None if fused is None else torch.split(fused, list(local_part_sizes(names, spec)))
    return None if names[0] not in sd else tuple(sd[n] for n in names)


def tp_forward(shards, spec: LayoutSpec, ids: torch.Tensor, model) -> torch.Tensor:
    """Logits computed rank by rank from NxD rank shards, with NxD's per-rank attention semantics."""
    cfg = model.config
    tp, hd = spec.tp, spec.model.head_dim
    ranks = []
    for t in range(tp):  # a TP rank's view across the pipeline: its shards of every PP stage
        sd: dict[str, torch.Tensor] = {}
        for p in range(spec.pp):
            sd.update(shards[(t, p)])
        ranks.append(sd)
    n_q = spec.model.heads // tp
    n_kv = spec.model.kv_heads * spec.kv_size_multiplier // tp
    bsz, seq = ids.shape

    vocab_local = ranks[0]["model.embed_tokens.weight"].shape[0]
    h = torch.zeros(bsz, seq, spec.model.hidden, dtype=torch.float64)
    for r, sd in enumerate(ranks):  # ParallelEmbedding: each rank looks up its vocab range, all-reduce
        local = ids - r * vocab_local
        mask = (local >= 0) & (local < vocab_local)
        h += sd["model.embed_tokens.weight"][local.clamp(0, vocab_local - 1)] * mask[..., None]

    cos, sin = model.model.rotary_emb(h, torch.arange(seq)[None])
    cos, sin = cos[:, None], sin[:, None]
    causal = torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1)
    for layer in range(spec.model.layers):
        pre = f"model.layers.{layer}"
        x = _rms(h, ranks[0][f"{pre}.input_layernorm.weight"], cfg.rms_norm_eps)
        attn = torch.zeros_like(h)
        for sd in ranks:
            wq, wk, wv = _qkv(sd, f"{pre}.self_attn", spec, "weight")
            biases = _qkv(sd, f"{pre}.self_attn", spec, "bias") or (None, None, None)
            q = torch.nn.functional.linear(x, wq, biases[0]).view(bsz, seq, n_q, hd).transpose(1, 2)
            k = torch.nn.functional.linear(x, wk, biases[1]).view(bsz, seq, n_kv, hd).transpose(1, 2)
            v = torch.nn.functional.linear(x, wv, biases[2]).view(bsz, seq, n_kv, hd).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            k = k.repeat_interleave(n_q // n_kv, dim=1)  # HF repeat_kv, used per rank by NxD's model
            v = v.repeat_interleave(n_q // n_kv, dim=1)
            scores = q @ k.transpose(-1, -2) / hd**0.5 + causal
            out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(bsz, seq, n_q * hd)
            attn += out @ sd[f"{pre}.self_attn.o_proj.weight"].T  # RowParallel: partial sums, all-reduce
        h = h + attn
        x = _rms(h, ranks[0][f"{pre}.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        mlp = torch.zeros_like(h)
        for sd in ranks:
            gate, up = (x @ sd[f"{pre}.mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
            mlp += (torch.nn.functional.silu(gate) * up) @ sd[f"{pre}.mlp.down_proj.weight"].T
        h = h + mlp
    h = _rms(h, ranks[-1]["model.norm.weight"], cfg.rms_norm_eps)
    return torch.cat([h @ sd["lm_head.weight"].T for sd in ranks], dim=-1)


CASES = [
    # (model kind, heads, kv_heads, spec flags)
    ("llama", 8, 2, dict(tp=4, hw="trn1", qkv_linear=True, kv_size_multiplier=2)),
    ("llama", 8, 2, dict(tp=4, hw="trn1", qkv_linear=True, kv_size_multiplier=2, fuse_qkv=True)),
    ("llama", 8, 2, dict(tp=4, hw="trn2", qkv_linear=True, kv_size_multiplier=2)),
    ("llama", 8, 2, dict(tp=4, hw="trn2", qkv_linear=True, kv_size_multiplier=2, fuse_qkv=True, pp=2)),
    ("llama", 8, 2, dict(tp=8, hw="trn1", qkv_linear=True, kv_size_multiplier=4, fuse_qkv=True)),
    ("llama", 8, 2, dict(tp=8, hw="trn2", qkv_linear=True, kv_size_multiplier=4)),
    ("llama", 8, 4, dict(tp=4, hw="trn1", qkv_linear=True, kv_size_multiplier=2)),  # 2 KV slots per rank
    ("llama", 8, 2, dict(tp=2, pp=2, hw="trn1")),  # plain q/k/v_proj, like nxd_from_full_tp2_pp2
    ("llama", 4, 4, dict(tp=2, fuse_qkv=True)),  # MHA stride-3 qkv_proj.weight
    ("qwen2", 8, 2, dict(tp=4, hw="trn2", qkv_linear=True, kv_size_multiplier=2, fuse_qkv=True)),
    ("qwen2", 8, 2, dict(tp=4, hw="trn1", qkv_linear=True, kv_size_multiplier=2)),
]


@pytest.mark.parametrize("kind,heads,kv_heads,flags", CASES, ids=lambda c: str(c))
def test_tp_forward_matches_full_model(kind, heads, kv_heads, flags):
    model = _model(kind, heads, kv_heads)
    spec = LayoutSpec.from_hf_config(model.config.to_dict(), **flags)
    state = {k: v for k, v in model.state_dict().items()}
    shards = full_state_to_nxd(state, spec)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        got = tp_forward(shards, spec, ids, model)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert nxd_to_full_state(shards, spec, verify_replicas=True).keys() == state.keys()


def _nxd_trn2_converter_kv(full: torch.Tensor, spec: LayoutSpec, tp_rank: int) -> torch.Tensor:
    """What NxD 0.18's ``convert_full_state_to_tp`` stores for weight_k/weight_v on trn2: it tiles with
    ``full.repeat(kv_size_multiplier, 1)`` (the trn1 rule) and narrows, while the trn2 model code builds
    KV with ``repeat_interleave`` and keeps Q contiguous."""
    tiled = full.repeat(spec.kv_size_multiplier, 1)
    size = tiled.shape[0] // spec.tp
    return tiled.narrow(0, tp_rank * size, size).clone()


def test_nxd_trn2_repeat_tiling_fails():
    """The check can fail: NxD's converter KV tiling on trn2 (Q unchanged, it is contiguous there too)."""
    model = _model("llama", 8, 2)
    spec = LayoutSpec.from_hf_config(
        model.config.to_dict(), tp=4, hw="trn2", qkv_linear=True, kv_size_multiplier=2
    )
    state = dict(model.state_dict())
    shards = full_state_to_nxd(state, spec)
    for layer in range(spec.model.layers):
        for p in "kv":
            full = state[f"model.layers.{layer}.self_attn.{p}_proj.weight"]
            for t in range(spec.tp):
                shards[(t, 0)][f"model.layers.{layer}.self_attn.qkv_proj.weight_{p}"] = (
                    _nxd_trn2_converter_kv(full, spec, t)
                )
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        got = tp_forward(shards, spec, ids, model)
    assert (got - want).abs().max() > 1e-3  # wrong Q/KV pairing on tp ranks 1 and 2
    # and our merge notices the inconsistent KV copies instead of silently returning wrong K/V
    with pytest.raises(LayoutError, match="copy stored on"):
        nxd_to_full_state(shards, spec, verify_replicas=True)


def test_trn1_layout_run_as_trn2_fails():
    """Same shards, wrong hardware rule: reading trn1 shards with the trn2 merge gives a different model."""
    model = _model("llama", 8, 2)
    cfg = model.config.to_dict()
    flags = dict(tp=4, qkv_linear=True, kv_size_multiplier=2)
    shards = full_state_to_nxd(dict(model.state_dict()), LayoutSpec.from_hf_config(cfg, hw="trn1", **flags))
    with pytest.raises(LayoutError):
        nxd_to_full_state(shards, LayoutSpec.from_hf_config(cfg, hw="trn2", **flags), verify_replicas=True)
