"""NxD's own LoRA modules, run on CPU (fixtures/nxd_lora/make_fixture.py: NxD 2.29's GQAQKVColumnParallelLinear,
ColumnParallelLinear, RowParallelLinear wrapped by its LoraModel on TP gloo ranks), loaded with strict=True the shards
``ckpt convert`` wrote from a PEFT adapter; this test checks that ckpt still writes exactly those shards, and that what
NxD's modules computed with them equals the PEFT model's forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt.converters.convert import convert
from ckpt.converters.options import ConvertOptions, load_config
from safetensors.torch import load_file

from ckpt.layouts import bit_equal, gqa
from ckpt.layouts.spec import LayoutSpec
from ckpt.safe_unpickle import load_torch_file

pytest.importorskip("peft")
FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nxd_lora"
CASES = ["tp2_m1", "tp4_m2"]


@pytest.fixture(scope="module")
def peft_model():  # noqa: ANN201
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(FIX / "base"), FIX / "adapter"
    ).eval()


def _spec(case: str) -> LayoutSpec:
    s = json.loads((FIX / case / "spec.json").read_text())
    return LayoutSpec.from_hf_config(load_config(str(FIX / "base")), tp=s["tp"], qkv_linear=True,
                                     kv_size_multiplier=s["kv_size_multiplier"], hw=s["hw"])  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_ckpt_writes_the_shards_nxd_lora_modules_held(case, tmp_path) -> None:  # noqa: ANN001
    spec = _spec(case)
    convert(str(FIX / "adapter"), str(tmp_path / "tag"), ConvertOptions.neuron(
        format="nxd", config=load_config(str(FIX / "base")), tp=spec.tp, qkv_linear=True,
        kv_size_multiplier=spec.kv_size_multiplier))  # fmt: skip
    held = load_file(str(FIX / case / "nxd_lora_state.safetensors"))
    for r in range(spec.tp):
        ours = load_torch_file(tmp_path / "tag" / "model" / f"dp_rank_00_tp_rank_{r:02d}_pp_rank_00.pt")
        ours.pop("lora_config")
        theirs = {k.split("/", 1)[1]: v for k, v in held.items() if k.startswith(f"rank{r}/")}
        assert set(ours) == set(theirs) and all(bit_equal(ours[k], theirs[k]) for k in ours), r


@pytest.mark.parametrize("case", CASES)
def test_nxd_lora_forward_equals_peft(case, peft_model) -> None:  # noqa: ANN001
    """Column layers: each rank's q/k/v and cat[gate_r, up_r] outputs are the PEFT outputs' rows that rank holds;
    row layers (all-reduced over ranks): the whole PEFT output.  fp32, so within 1e-5: a TP-split matmul sums in
    another order than the whole one."""
    spec = _spec(case)
    out = load_file(str(FIX / case / "nxd_outputs.safetensors"))
    x = load_file(str(FIX / "x.safetensors"))["x"]
    hd, inter = spec.model.head_dim, spec.model.intermediate

    def rows(heads: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in heads])

    checked = 0
    with torch.no_grad():
        for i, layer in enumerate(peft_model.base_model.model.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            q, k, v, g, u = a.q_proj(x), a.k_proj(x), a.v_proj(x), mlp.gate_proj(x), mlp.up_proj(x)
            whole = {"o": a.o_proj(q), "down": mlp.down_proj(torch.nn.functional.silu(g) * u)}
            for r in range(spec.tp):
                qi, ki = rows(gqa.q_heads_of_rank(spec, r)), rows(gqa.kv_heads_of_rank(spec, r))
                mine = torch.arange(r * inter // spec.tp, (r + 1) * inter // spec.tp)
                want = {"q": q[..., qi], "k": k[..., ki], "v": v[..., ki],
                        "gate_up": torch.cat([g[..., mine], u[..., mine]], -1), **whole}  # fmt: skip
                for key, w in want.items():
                    got = out[f"rank{r}.{i}.{key}"]
                    assert got.shape == w.shape and torch.allclose(got, w, rtol=1e-5, atol=1e-5), (r, i, key)
                    checked += 1
    assert checked == spec.tp * spec.model.layers * 6
    # the adapter matters: without it the outputs differ
    with torch.no_grad(), peft_model.disable_adapter():
        q0 = peft_model.base_model.model.model.layers[0].self_attn.q_proj(x)
    assert not torch.allclose(out["rank0.0.q"], q0[..., rows(gqa.q_heads_of_rank(spec, 0))], atol=1e-3)


@pytest.mark.parametrize("case", CASES)
def test_optimizer_pid_order_is_nxd_lora_model_order(case) -> None:
    """ckpt writes NxD LoRA optimizer files with pids in the order NxD's LoraModel lists its trainable parameters."""
    from ckpt.converters.lora_optim import module_order

    order = json.loads((FIX / case / "spec.json").read_text())["trainable_order"]
    held = load_file(str(FIX / case / "nxd_lora_state.safetensors"))
    for rank, names in order.items():
        mine = sorted((k.split("/", 1)[1] for k in held if k.startswith(f"{rank}/")), key=module_order)
        assert mine == names and len(names) == 20
