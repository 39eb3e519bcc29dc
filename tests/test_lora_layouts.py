"""NxD LoRA layout (ckpt/layouts/lora.py) round trips over random models and parallel layouts (hypothesis): HF adapter
-> NxD rank shards -> HF adapter is the identity, bit for bit, and every rank shard has the size NxD's LoRA layer
gives it (lora_B rows = the base weight's rows on that rank for column layers, lora_A columns for row layers)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.layouts import bit_equal, full_state_to_nxd
from ckpt.layouts.lora import adapter_to_nxd, hf_lora_names, nxd_lora_name, nxd_to_adapter
from tests.test_layouts_roundtrip import specs

MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def _adapter(spec, r: int, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:  # noqa: ANN001
    g = torch.Generator().manual_seed(seed)
    shapes = spec.model.hf_shapes()
    out: dict[str, torch.Tensor] = {}
    for i in range(spec.model.layers):
        shared: dict[str, torch.Tensor] = {}
        for mod in MODULES:
            o, n = shapes[f"model.layers.{i}.{mod}.weight"]
            key = "mlp" if mod.startswith("mlp.") and mod != "mlp.down_proj" else mod
            if spec.qkv_linear or spec.fuse_qkv:
                key = (
                    "qkv"
                    if mod[-6] in "qkv" and mod.startswith("self_attn") and mod != "self_attn.o_proj"
                    else key
                )
            a = torch.randn(r, n, generator=g).to(dtype)
            a = shared.setdefault(key, a)
            out[f"model.layers.{i}.{mod}.lora_A.weight"] = a.clone()
            out[f"model.layers.{i}.{mod}.lora_B.weight"] = torch.randn(o, r, generator=g).to(dtype)
    return out


@settings(max_examples=40, deadline=None)
@given(spec=specs(), r=st.integers(1, 3), seed=st.integers(0, 2**16), bf16=st.booleans())
def test_round_trip_and_shard_sizes(spec, r, seed, bf16) -> None:  # noqa: ANN001
    ad = _adapter(spec, r, seed, torch.bfloat16 if bf16 else torch.float32)
    shards = adapter_to_nxd(ad, spec)
    back = nxd_to_adapter(shards, spec)
    assert set(back) == set(ad)
    assert all(bit_equal(back[k], ad[k]) for k in ad)
    base = full_state_to_nxd({k: torch.zeros(v) for k, v in spec.model.hf_shapes().items()}, spec)
    for rank, sd in shards.items():
        for name, t in sd.items():
            mod, ab, leaf = (
                name.rpartition(".lora_")[0],
                name.rpartition(".lora_")[2][0],
                name.rsplit(".", 1)[1],
            )
            row_layer = mod.endswith(("o_proj", "down_proj"))
            w = (
                base[rank][f"{mod}.{leaf}" if not row_layer else f"{mod}.weight"]
                if ab == "B" or row_layer
                else None
            )
            if ab == "B" and not row_layer:
                assert t.shape == (w.shape[0], r)  # rows follow the base weight's rows on this rank
            elif ab == "A" and row_layer:
                assert t.shape == (r, w.shape[1])  # columns follow the base weight's columns on this rank
            else:
                assert t.shape[0 if ab == "A" else 1] == r
            assert nxd_lora_name(hf_lora_names(name)[0], spec) == name


def test_whole_lora_matrices_are_explicit_replicated_rules() -> None:
    """The LoRA matrices NxD keeps whole (no parallel attributes to read at save time) are named by the nxd-llama
    rule set; the split ones are not (the Neuron saver takes their split from NxD's attributes)."""
    from ckpt.layouts.families.llama import RULES as NXD_LLAMA
    from ckpt.layouts.partition import nxd_partition
    from ckpt.layouts.rules import Kind, rule_for

    for name in ("model.layers.0.self_attn.qkv_proj.lora_A.weight", "model.layers.3.mlp.gate_up_proj.lora_A.weight",
                 "model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.1.self_attn.o_proj.lora_B.weight",
                 "model.layers.1.mlp.down_proj.lora_B.weight"):  # fmt: skip
        rule = rule_for(name, NXD_LLAMA)
        assert rule.kind is Kind.REPLICATED and rule.pattern != "", name
        assert nxd_partition(name) is None
    for name in (
        "model.layers.0.self_attn.qkv_proj.lora_B.weight_q",
        "model.layers.0.self_attn.o_proj.lora_A.weight",
    ):
        assert all(not r.matches(name) for r in NXD_LLAMA if r.kind is Kind.REPLICATED and r.pattern), name
