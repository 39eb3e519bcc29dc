"""neuron <-> cuda round trips through our manifest on disk, over random model dims and parallel flags: bit-exact.

Each example writes a random CUDA-layout checkpoint (model, AdamW-like moments, scalar step, param_groups, RNG with
an XLA seed), converts it to a random valid Neuron layout, checks the Neuron manifest against the layout engine's
own split (the docs/format.md contract: logical tensor = TP shards concatenated along the partition dim), converts
it back and compares every byte and every tree.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from ckpt.converters.convert import ConvertOptions, convert
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from ckpt import open_checkpoint
from ckpt.errors import LayoutError
from ckpt.format import treecodec
from ckpt.layouts import LayoutSpec, bit_equal, full_state_to_nxd
from ckpt.layouts.partition import nxd_partition
from ckpt.layouts.pipeline import pp_ranks_of
from ckpt.saving.writer import StreamingWriter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_config(draw) -> dict:
    head_dim = draw(st.sampled_from([2, 4]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * group
    return {
        "model_type": draw(st.sampled_from(["llama", "mistral", "qwen2"])),
        "hidden_size": draw(st.sampled_from([8, 16])),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": draw(st.integers(2, 5)),
        "vocab_size": draw(st.sampled_from([16, 32])),
        "intermediate_size": draw(st.sampled_from([8, 24])),
        "tie_word_embeddings": False,
    }


def full_names(cfg: dict, bias: bool) -> dict[str, tuple[int, ...]]:
    """Like ``ModelDims.hf_shapes`` but with each layer's q/k/v biases after its other tensors: the order in which
    the converter re-expands fused NxD tensors, so that param_groups compare equal after a round trip."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, inter = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    out = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out |= {
            f"{p}.self_attn.q_proj.weight": (q, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.mlp.gate_proj.weight": (inter, h),
            f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        }
        if bias:
            out |= {f"{p}.self_attn.{x}_proj.bias": ((q if x == "q" else kv),) for x in "qkv"}
    out |= {"model.norm.weight": (h,), "lm_head.weight": (cfg["vocab_size"], h)}
    return out


def rand(shape, dtype, g):
    return torch.randn(shape, generator=g).to(dtype)


def write_cuda_checkpoint(
    path: Path, cfg: dict, dtype: torch.dtype, bias: bool, seed: int
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    w = StreamingWriter(str(path))
    names = full_names(cfg, bias)
    for n, shape in names.items():
        t = rand(shape, dtype, g)
        tensors[n] = t
        w.add(n, t)
        for key in ("exp_avg", "exp_avg_sq"):
            m = rand(shape, torch.float32, g)
            tensors[f"optim/{n}/{key}"] = m
            w.add(f"optim/{n}/{key}", m, role="optimizer_state", param=n, key=key)
    opt = {
        "type": "torch.optim.adamw.AdamW",
        "param_groups": [
            {
                "lr": 0.001,
                "betas": treecodec.encode((0.9, 0.95)),
                "params": [n for n in names if "norm" not in n],
            },
            {
                "lr": 0.002,
                "betas": treecodec.encode((0.9, 0.95)),
                "params": [n for n in names if "norm" in n],
            },
        ],
        "state": {n: {"step": treecodec.encode(torch.tensor(7.0))} for n in names},
    }
    rng = {"0": {"torch": treecodec.encode(torch.get_rng_state()), "xla_seed": 1234}}
    w.commit(
        step=7,
        backend="cuda",
        trees={
            "optimizer": opt,
            "rng": rng,
            "scheduler": {"last_epoch": 7},
            "progress": {"step": 7, "tokens": 99},
            "data": {"0": {"pos": 5}},
            "tokenizer": {"name": "tok", "revision": "r", "sha256": "0" * 64, "files": []},
            "extra": {"config": cfg},
        },
    )
    return tensors


@st.composite
def cases(draw):
    cfg = random_config(draw)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    qkv_linear = draw(st.booleans())
    hw = draw(st.sampled_from(["trn1", "trn2"]))
    tps = [
        t
        for t in (1, 2, 4, 8)
        if heads % t == 0 and cfg["vocab_size"] % t == 0 and cfg["intermediate_size"] % t == 0
    ]
    tp = draw(st.sampled_from(tps))
    mult = 1
    if qkv_linear:
        mults = [m for m in (1, 2, 4) if (kv * m) % tp == 0 and tp % m == 0 and (heads // kv) % m == 0]
        mults = [m for m in mults if not (hw == "trn2" and m > 1 and kv * m != tp)] or [1]
        mult = draw(st.sampled_from(mults))
    fuse = draw(st.booleans()) and (qkv_linear or heads == kv)
    layers = cfg["num_hidden_layers"]
    pp = draw(st.sampled_from([p for p in (1, 2) if p <= layers]))
    vpp = draw(st.sampled_from([v for v in (1, 2) if pp * v <= layers]))
    flags = dict(
        tp=tp, pp=pp, virtual_pp=vpp, kv_size_multiplier=mult, hw=hw, fuse_qkv=fuse, qkv_linear=qkv_linear
    )
    return cfg, flags, draw(st.sampled_from(DTYPES)), draw(st.booleans()), draw(st.integers(0, 1000))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_neuron_cuda_roundtrip_bit_exact(case) -> None:
    cfg, flags, dtype, bias, seed = case
    try:
        spec = LayoutSpec.from_hf_config(cfg, **flags)
    except LayoutError:
        assume(False)  # an impossible combination: the CLI test covers the refusal
        return
    event(
        f"tp={spec.tp} pp={spec.pp} vpp={spec.virtual_pp} m={spec.kv_size_multiplier} qkv_linear={spec.qkv_linear}"
    )
    roundtrip(cfg, spec, flags, dtype, bias, seed)


HARD = [
    # GQA with KV replication: trn2 (adjacent copies) and trn1 (tiled copies), fused weight_qkv, biases, PP + vPP
    (
        dict(num_attention_heads=8, num_key_value_heads=2),
        dict(tp=4, pp=2, virtual_pp=2, kv_size_multiplier=2, hw="trn2", qkv_linear=True),
    ),
    (
        dict(num_attention_heads=8, num_key_value_heads=2),
        dict(tp=8, kv_size_multiplier=4, hw="trn1", qkv_linear=True, fuse_qkv=True),
    ),
    (dict(num_attention_heads=4, num_key_value_heads=4), dict(tp=2, pp=2, fuse_qkv=True)),
    (
        dict(num_attention_heads=8, num_key_value_heads=2),
        dict(tp=4, kv_size_multiplier=4, hw="trn1", qkv_linear=True),
    ),
]


@pytest.mark.parametrize("over,flags", HARD)
def test_roundtrip_hard_cases(over: dict, flags: dict) -> None:
    cfg = {
        "model_type": "qwen2",
        "hidden_size": 16,
        "head_dim": 4,
        "num_hidden_layers": 5,
        "vocab_size": 32,
        "intermediate_size": 16,
        "tie_word_embeddings": False,
        **over,
    }
    spec = LayoutSpec.from_hf_config(cfg, **flags)
    roundtrip(cfg, spec, flags, torch.bfloat16, True, 3)


def roundtrip(cfg: dict, spec: LayoutSpec, flags: dict, dtype: torch.dtype, bias: bool, seed: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        tensors = write_cuda_checkpoint(root / "cuda", cfg, dtype, bias, seed)
        convert(str(root / "cuda"), str(root / "neuron"), ConvertOptions.neuron(**flags))
        neuron = open_checkpoint(str(root / "neuron"))
        m = neuron.manifest
        assert m.layout.kind == "nxd" and m.backend == "neuron" and m.layout.tp == spec.tp
        assert m.extra["nxd"]["hw"] == spec.hw and m.extra["nxd"]["config"] == cfg
        # the contract: each logical NxD tensor = TP shards (what the layout engine makes) concatenated
        model = {n: t for n, t in tensors.items() if not n.startswith("optim/")}
        shards = full_state_to_nxd(model, spec)
        for name in neuron.names("parameter"):
            pp = pp_ranks_of(name, spec)[0]
            dim = (nxd_partition(name) or (None,))[0]
            locals_ = [shards[(t, pp)][name] for t in range(spec.tp)]
            expect = locals_[0] if dim is None else torch.cat(locals_, dim)
            assert bit_equal(neuron.read(name), expect), name
            assert (m.tensors[name].partition is None) == (dim is None)
        assert m.rng["0"]["xla_seed"] == 1234
        # and back
        convert(str(root / "neuron"), str(root / "back"), ConvertOptions(to="cuda", from_="neuron"))
        back = open_checkpoint(str(root / "back"))
        assert set(back.names()) == set(tensors)
        for n, t in tensors.items():
            assert bit_equal(back.read(n), t), n
        src = open_checkpoint(str(root / "cuda")).manifest
        bm = back.manifest
        assert bm.optimizer == src.optimizer
        assert (
            bm.step == 7
            and bm.progress == src.progress
            and bm.data == src.data
            and bm.tokenizer == src.tokenizer
        )
        assert bm.scheduler == src.scheduler
        assert "xla_seed" not in bm.rng["0"] and bm.extra["neuron_rng"]["0"]["xla_seed"] == 1234
        assert bm.rng["0"]["torch"] == src.rng["0"]["torch"]
