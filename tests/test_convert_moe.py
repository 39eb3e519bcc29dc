"""``ckpt convert`` of MoE models (Mixtral, Qwen3-MoE) between HF and the Neuron layout with expert parallelism:
the Neuron manifest holds NxD's stacked ``expert_mlps`` tensors (logical ``[E, H, 2I]`` / ``[E, I, H]``, TP-split on
dim 2 / 1, ``partition.ep``), each (tp, ep) rank's box equals what NxD's layers hold (``ckpt.layouts.experts``), and
converting back to HF gives a model ``transformers`` loads with the original logits.  The streaming converter reads
and writes one expert slot at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt.converters.convert import convert
from ckpt.converters.options import ConvertOptions
from safetensors.torch import load_file

from ckpt.format.reader import CheckpointReader
from ckpt.layouts import LayoutSpec
from ckpt.layouts.experts import full_state_to_nxd_ep

transformers = pytest.importorskip("transformers")
BASE = {
    "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "vocab_size": 32, "max_position_embeddings": 32,
}  # fmt: skip
CONFIGS = {
    "mixtral": {"intermediate_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"intermediate_size": 8, "moe_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2,
                  "head_dim": 8},
}  # fmt: skip


def hf_dir(model_type: str, tmp: Path):
    cfg = {"model_type": model_type, **BASE, **CONFIGS[model_type]}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp / "hf")
    return model, cfg, tmp / "hf"


@pytest.mark.parametrize(
    "model_type, flags", [("mixtral", {"tp": 2, "ep": 2}), ("qwen3_moe", {"tp": 2, "ep": 2, "pp": 2})]
)
def test_hf_to_neuron_ep_and_back_to_hf(model_type, flags, tmp_path):
    model, cfg, src = hf_dir(model_type, tmp_path)
    state = load_file(str(src / "model.safetensors"))
    neuron = tmp_path / "neuron"
    convert(str(src), str(neuron), ConvertOptions(to="neuron", layout=flags))
    reader = CheckpointReader(str(neuron))
    m = reader.manifest
    assert (m.layout.tp, m.layout.pp, m.layout.ep) == (flags["tp"], flags.get("pp", 1), 2)
    spec = LayoutSpec.from_hf_config(cfg, **flags)
    truth = full_state_to_nxd_ep(state, spec)  # what NxD's layers hold (tests/test_nxd_layers_truth.py)
    for proj, dim in (("gate_up", 2), ("down", 1)):
        name = f"model.layers.1.mlp.expert_mlps.mlp_op.{proj}_proj.weight"
        entry = reader.entry(name)
        assert entry.partition == {"dim": dim, "stride": 2 if proj == "gate_up" else 1, "tp": 2,
                                   "source": spec.rule_set, "ep": 2}  # fmt: skip
        full = reader.read(name)
        for (t, p, k), sd in truth.items():
            if name not in sd:
                continue
            local = sd[name]
            box = [slice(k * 2, (k + 1) * 2), slice(None), slice(None)]
            box[dim] = slice(t * local.shape[dim], (t + 1) * local.shape[dim])
            assert torch.equal(full[tuple(box)], local), (name, t, p, k)
    router = "model.layers.0.mlp.router.linear_router.weight"
    assert reader.entry(router).partition is None
    back = tmp_path / "back"
    convert(str(neuron), str(back), ConvertOptions(to="cuda", format="hf"))
    got = {}
    for f in sorted(back.glob("*.safetensors")):
        got |= load_file(str(f))
    assert got.keys() == state.keys()
    assert all(torch.equal(got[n], t) for n, t in state.items())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    ids = torch.randint(0, 32, (2, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
