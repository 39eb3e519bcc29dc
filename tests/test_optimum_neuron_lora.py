"""PEFT adapter -> optimum-neuron LoRA folder (``--format optimum-neuron``) -> PEFT, in the main environment.

optimum-neuron's own consolidation and ``NeuronPeftModel`` reading these folders run in the Trainium-stack
environment (tests_trainium/test_optimum_lora.py); here, without optimum-neuron: the round trip through ckpt's writer
and reader is exact over layouts optimum-neuron picks (hypothesis), the metadata says what each rank file holds, and
what optimum-neuron cannot hold is refused with nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt.converters.optimum_neuron import read_lora_checkpoint
from ckpt.converters.optimum_neuron_lora import optimum_layout, write_adapter_folder
from ckpt.converters.peft import Adapter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt.errors import LayoutError

MODS = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv", "self_attn.o_proj": "o",
        "mlp.gate_proj": "i", "mlp.up_proj": "i", "mlp.down_proj": "d"}  # fmt: skip


def config(heads: int, kv: int, layers: int) -> dict:
    return {"model_type": "llama", "vocab_size": 64, "hidden_size": 8 * heads, "intermediate_size": 24,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 8}  # fmt: skip


def adapter(cfg: dict, r: int, seed: int) -> Adapter:
    """A LoRA of every linear module; the parts of each fused layer share one lora_A (as optimum-neuron holds it)."""
    g = torch.Generator().manual_seed(seed)
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    out = {"q": (cfg["num_attention_heads"] * hd, h), "kv": (cfg["num_key_value_heads"] * hd, h), "o": (h, h),
           "i": (cfg["intermediate_size"], h), "d": (h, cfg["intermediate_size"])}  # fmt: skip
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg["num_hidden_layers"]):
        shared = {"attn": torch.randn(r, h, generator=g), "mlp": torch.randn(r, h, generator=g)}
        for mod, kind in MODS.items():
            o, i = out[kind]
            base = f"model.layers.{layer}.{mod}"
            fused = "mlp" if kind == "i" else "attn" if kind in ("q", "kv") else None
            a = shared[fused] if fused else torch.randn(r, i, generator=g)
            tensors[f"{base}.lora_A.weight"] = a.clone()
            tensors[f"{base}.lora_B.weight"] = torch.randn(o, r, generator=g)
    peft_cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": sorted(m.split(".")[1] for m in MODS),
                "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    return Adapter.of_config(tensors, peft_cfg)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.sampled_from([(4, 1), (4, 2), (4, 4), (8, 2)]),
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2]),
    xser=st.booleans(),
    fuse=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_adapter_round_trips_through_optimum_neuron_layout(
    shape, tp, pp, xser, fuse, seed, tmp_path: Path
) -> None:
    heads, kv = shape
    cfg = config(heads, kv, layers=2)
    ad = adapter(cfg, r=2, seed=seed)
    qkv_linear = kv < tp or kv % tp != 0
    fuse = fuse and (qkv_linear or heads == kv)  # where optimum-neuron's Llama can fuse q/k/v
    spec = optimum_layout(cfg, {"tp": tp, "pp": pp, "fuse_qkv": fuse})
    assert spec.qkv_linear == qkv_linear and spec.fuse_qkv == fuse
    dst = tmp_path / f"on-{heads}-{kv}-{tp}-{pp}-{xser}-{fuse}-{seed}"
    write_adapter_folder(ad, spec, str(dst), xser=xser, config=cfg)
    back = read_lora_checkpoint(str(dst), config=cfg)
    assert sorted(back.tensors) == sorted(ad.tensors)
    for name, t in ad.tensors.items():
        assert torch.equal(back.tensors[name], t), name
    tag = dst / "adapter_default" / "adapter_shards"
    for p in range(pp):
        meta = json.loads((tag / f"mp_metadata_pp_rank_{p}.json").read_text())
        for name, attrs in meta["parameters"].items():
            assert ".lora_A.default." in name or ".lora_B.default." in name
            row = name.split(".lora_")[0].endswith(("o_proj", "down_proj"))
            split = (".lora_B." in name) != row
            assert attrs["tensor_model_parallel"] == split, name
            if split:
                assert attrs["partition_dim"] == (1 if row else 0) and attrs["num_partitions"] == tp
        kinds = {c for m in meta["model_weight_transformation_specs"] for c, _ in m["specs"]}
        assert "FusedLinearsSpec" in kinds
        assert ("GQAQKVColumnParallelLinearSpec" in kinds) == spec.qkv_linear


@pytest.mark.parametrize(
    "change, layout, match",
    [
        ("up_proj A", {"tp": 2}, r"gate_up_proj\.lora_A\.weight shares one lora_A"),
        ("k_proj A", {"tp": 4}, r"qkv_proj\.lora_A\.weight shares one lora_A"),
        ("no up_proj", {"tp": 2}, r"adapted without model\.layers\.0\.mlp\.up_proj"),
        (None, {"tp": 4, "hw": "trn2"}, r"--hw trn2: optimum-neuron lays KV copies out tiled"),
        (
            None,
            {"tp": 2, "qkv_linear": True},
            r"--qkv-linear True: optimum-neuron's Llama uses qkv_linear=False",
        ),
        (None, {"tp": 4, "kv_size_multiplier": 4}, r"--kv-size-multiplier 4 does not divide"),
        (None, {"tp": 2, "kv_size_multiplier": 2}, r"--kv-size-multiplier 2: optimum-neuron's Llama uses"),
        (None, {"tp": 2, "fuse_qkv": True}, r"--fuse-qkv: optimum-neuron's Llama fuses q/k/v without"),
    ],
)
def test_what_optimum_neuron_cannot_hold_is_refused_and_nothing_written(
    change, layout, match, tmp_path
) -> None:
    cfg = config(4, 2, layers=1)
    ad = adapter(cfg, r=2, seed=0)
    if change == "up_proj A":
        ad.tensors["model.layers.0.mlp.up_proj.lora_A.weight"] += 1
    elif change == "k_proj A":
        ad.tensors["model.layers.0.self_attn.k_proj.lora_A.weight"] += 1
    elif change == "no up_proj":
        for ab in "AB":
            del ad.tensors[f"model.layers.0.mlp.up_proj.lora_{ab}.weight"]
    with pytest.raises(LayoutError, match=match):
        write_adapter_folder(ad, optimum_layout(cfg, layout), str(tmp_path / "on"))
    assert not (tmp_path / "on").exists()
