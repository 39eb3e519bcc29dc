"""LoRA both ways with optimum-neuron's own code (issue 35, item 3).

A real PEFT adapter (``peft.get_peft_model`` on a tiny Llama, a few AdamW steps, ``save_pretrained``) and a real LoRA
Trainer ``checkpoint-N`` (``examples/hf_trainer.py --lora``) are converted by ckpt to optimum-neuron's adapter layout
(``--format optimum-neuron``: ``adapter_default/adapter_shards`` + ``mp_metadata_pp_rank_*.json``); optimum-neuron
0.4.5's own consolidation (``consolidate_model_parallel_checkpoints_to_unified_checkpoint``, what ``optimum-cli
neuron consolidate`` runs), unmodified, gives back the original adapter bit for bit, PEFT loads that output into the
base model, and ckpt converts the folder back to a PEFT folder equal to the source.

Adapters of optimum-neuron's fused layers (``gate_up_proj``; ``qkv_proj`` where it uses
``GQAQKVColumnParallelLinear``) with one ``lora_A`` per layer are what its own save and consolidation produce (it
duplicates the shared ``lora_A`` into each part); a PEFT-trained adapter with different ``lora_A`` per part is
refused (optimum-neuron's own loading would silently replace them by their mean; shown here with its own function).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("optimum.neuron")


def llama_config(kv_heads: int, heads: int = 4, layers: int = 2) -> dict:
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": 32 // heads, "max_position_embeddings": 16,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32",
    }  # fmt: skip


def peft_adapter(dst: Path, cfg: dict, targets: list[str], *, shared_a: bool, seed: int = 0) -> dict:
    """Train a PEFT LoRA for 3 AdamW steps and ``save_pretrained`` it; with ``shared_a`` the parts of each
    optimum-neuron fused layer get one ``lora_A`` (as its consolidation writes them).  Returns its tensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(LlamaForCausalLM(LlamaConfig(**cfg)), LoraConfig(r=4, lora_alpha=8,
                                                                            target_modules=targets))  # fmt: skip
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        ids = torch.randint(0, cfg["vocab_size"], (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    if shared_a:
        with torch.no_grad():
            for name, mod in model.named_modules():
                for first, rest in (("gate_proj", ("up_proj",)), ("q_proj", ("k_proj", "v_proj"))):
                    if name.endswith(first) and hasattr(mod, "lora_A"):
                        parent = model.get_submodule(name.rsplit(".", 1)[0])
                        if not all(hasattr(getattr(parent, o), "lora_A") for o in rest):
                            continue  # not fused by optimum-neuron unless every part is adapted
                        for other in rest:
                            getattr(parent, other).lora_A["default"].weight.copy_(
                                mod.lora_A["default"].weight
                            )
    model.save_pretrained(str(dst))
    return load_file(str(dst / "adapter_model.safetensors"))


def convert(src: Path, dst: Path, cfg: dict, fmt: str, **layout: object) -> object:
    from ckpt.converters.lora import convert_adapter
    from ckpt.converters.options import ConvertOptions

    to = "neuron" if fmt == "optimum-neuron" else "cuda"
    return convert_adapter(str(src), str(dst), ConvertOptions(to=to, format=fmt, layout=layout, config=cfg))


def consolidate(folder: Path, out: Path) -> dict[str, torch.Tensor]:
    from optimum.neuron.models.training.checkpointing import (
        consolidate_model_parallel_checkpoints_to_unified_checkpoint,
    )

    consolidate_model_parallel_checkpoints_to_unified_checkpoint(folder, out)
    return load_file(str(out / "adapter_model.safetensors"))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = [  # (kv heads, layout, targets): optimum-neuron picks the attention layer from kv heads and tp
    pytest.param(2, {"tp": 1}, ["q_proj", "v_proj"], id="tp1-peft-default-targets"),
    pytest.param(2, {"tp": 2}, ["q_proj", "v_proj"], id="tp2-separate-qkv"),
    pytest.param(2, {"tp": 2, "pp": 2}, ALL, id="tp2-pp2-all-linear"),
    pytest.param(1, {"tp": 2}, ALL, id="tp2-gqa-m2-trn1"),
    pytest.param(1, {"tp": 2, "hw": "trn2"}, ALL, id="tp2-gqa-m2-trn2-one-kv-head"),
    pytest.param(2, {"tp": 4}, ALL, id="tp4-gqa-m2-trn1"),
    pytest.param(1, {"tp": 2, "xser": False}, ALL, id="tp2-gqa-plain-files"),
    pytest.param(1, {"tp": 2, "fuse_qkv": True}, ALL, id="tp2-gqa-fuse-qkv"),
    pytest.param(4, {"tp": 2, "fuse_qkv": True}, ALL, id="tp2-mha-fuse-qkv"),
]


@pytest.mark.parametrize("kv,layout,targets", CASES)
def test_optimum_neuron_consolidation_gives_back_the_adapter(kv, layout, targets, tmp_path) -> None:
    cfg = llama_config(kv)
    src = tmp_path / "peft"
    want = peft_adapter(src, cfg, targets, shared_a=True)
    layout = dict(layout)
    xser = layout.pop("xser", True)
    from ckpt.converters.lora import convert_adapter
    from ckpt.converters.options import ConvertOptions

    dst = tmp_path / "on"
    opts = ConvertOptions(to="neuron", format="optimum-neuron", layout=layout, config=cfg, xser=xser)
    convert_adapter(str(src), str(dst), opts)
    tag = dst / "adapter_default" / "adapter_shards"
    assert (tag / "done").is_file() and (tag / "mp_metadata_pp_rank_0.json").is_file()
    assert any(p.name.endswith(".tensors") for p in (tag / "model").iterdir()) == xser
    trn = json.loads((dst / "trn_config.json").read_text())
    assert trn["tensor_parallel_size"] == layout["tp"]
    # optimum-neuron's own consolidation, unmodified
    out = tmp_path / "consolidated"
    assert_same(consolidate(dst, out), want)
    # PEFT loads what it wrote into the base model (the adapter config travels beside the shards, as a user copies it)
    shutil.copy(dst / "adapter_default" / "adapter_config.json", out / "adapter_config.json")
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    loaded = PeftModel.from_pretrained(LlamaForCausalLM(LlamaConfig(**cfg)), str(out))
    sd = {k.replace(".default.", "."): v for k, v in loaded.state_dict().items() if ".lora_" in k}
    assert_same(sd, want)
    # and back: ckpt reads optimum-neuron's layout into a PEFT folder equal to the source
    back = tmp_path / "back"
    convert(dst, back, cfg, "peft")
    assert_same(load_file(str(back / "adapter_model.safetensors")), want)
    assert json.loads((back / "adapter_config.json").read_text()) == json.loads(
        (src / "adapter_config.json").read_text()
    )


def test_peft_trained_fused_parts_are_refused_where_optimum_neuron_would_average_them(tmp_path) -> None:
    """A PEFT adapter trained on gate_proj and up_proj has two lora_A; optimum-neuron's own loading
    (``FusedLinearsSpec._lora_adapt_state_dict``) keeps their mean, so ckpt refuses rather than write that."""
    from ckpt.errors import LayoutError

    cfg = llama_config(2)
    src = tmp_path / "peft"
    want = peft_adapter(src, cfg, ALL, shared_a=False)
    gate, up = (
        want[f"base_model.model.model.layers.0.mlp.{p}.lora_A.weight"] for p in ("gate_proj", "up_proj")
    )
    assert not torch.equal(gate, up)
    with pytest.raises(LayoutError, match="gate_up_proj.lora_A.weight shares one lora_A"):
        convert(src, tmp_path / "on", cfg, "optimum-neuron", tp=2)
    assert not (tmp_path / "on").exists()
    # what optimum-neuron's own loading would make of it: the mean, not either lora_A
    from optimum.neuron.models.training.transformations_utils import FusedLinearsSpec

    spec = FusedLinearsSpec(fused_linear_name="gate_up_proj", linear_names=["gate_proj", "up_proj"], bias=False,
                            fuse_axis="column", original_dims=[48, 48], tp_size=1)  # fmt: skip
    spec.peft_type = "lora"
    mod = "model.layers.0.mlp"
    sd = {f"{mod}.{p}.lora_{ab}.weight": want[f"base_model.model.{mod}.{p}.lora_{ab}.weight"].clone()
          for p in ("gate_proj", "up_proj") for ab in "AB"}  # fmt: skip
    params = {f"{mod}.gate_up_proj.lora_A.default.weight": torch.nn.Parameter(torch.empty(4, 32))}
    from _one_rank import one_rank

    with one_rank():  # its function asks NxD for the TP size
        out = spec._lora_adapt_state_dict(mod, params, sd, {}, inplace=True)
    assert torch.equal(out[f"{mod}.gate_up_proj.lora_A.weight"], torch.stack([gate, up]).mean(0))


@pytest.mark.parametrize(
    "kv,layout,targets,match",
    [
        (2, {"tp": 2}, ["gate_proj", "q_proj"], "adapted without model.layers.0.mlp.up_proj"),
        (1, {"tp": 2}, ["q_proj", "v_proj"], "adapted without model.layers.0.self_attn.k_proj"),
        (2, {"tp": 4, "hw": "trn2"}, ALL, "--hw trn2: optimum-neuron lays KV copies out tiled"),
        (
            1,
            {"tp": 2, "qkv_linear": False},
            ALL,
            "--qkv-linear False: optimum-neuron's Llama uses qkv_linear=True",
        ),
    ],
)
def test_layouts_optimum_neuron_cannot_hold_are_refused(kv, layout, targets, match, tmp_path) -> None:
    from ckpt.errors import LayoutError

    cfg = llama_config(kv)
    peft_adapter(tmp_path / "peft", cfg, targets, shared_a=True)
    with pytest.raises(LayoutError, match=match):
        convert(tmp_path / "peft", tmp_path / "on", cfg, "optimum-neuron", **layout)
    assert not (tmp_path / "on").exists()


def test_lora_trainer_checkpoint_to_optimum_neuron_and_back(tmp_path) -> None:
    """A real ``transformers.Trainer`` LoRA ``checkpoint-2`` (PEFT's default targets q_proj, v_proj): the adapter
    consolidates back bit for bit, the step and scheduler travel at the root, the optimizer is said not written."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_integration_transformers import train

    out = tmp_path / "run"
    assert train(out, "--lora", "--lora-targets", "default", "--steps", 2, "--save-every", 2) == 0
    ckpt_dir = out / "checkpoint-2"
    sys.path.insert(0, str(ROOT / "examples"))
    from hf_trainer import tiny_llama

    cfg = tiny_llama().config.to_dict()
    res = convert(ckpt_dir, tmp_path / "on", cfg, "optimum-neuron", tp=2)
    assert any("optimizer state" in n for n in res.notes)
    assert json.loads((tmp_path / "on" / "trainer_state.json").read_text())["global_step"] == 2
    sched = torch.load(tmp_path / "on" / "scheduler.pt", weights_only=True)
    assert sched == torch.load(ckpt_dir / "scheduler.pt", weights_only=True)
    want = load_file(str(ckpt_dir / "adapter_model.safetensors"))
    assert_same(consolidate(tmp_path / "on", tmp_path / "cons"), want)
    convert(tmp_path / "on", tmp_path / "back", cfg, "peft")
    assert_same(load_file(str(tmp_path / "back" / "adapter_model.safetensors")), want)
    # and on to a Trainer folder: the step and the scheduler came along
    convert(tmp_path / "on", tmp_path / "trainer", cfg, "hf-trainer")
    assert json.loads((tmp_path / "trainer" / "trainer_state.json").read_text())["global_step"] == 2
    assert torch.load(tmp_path / "trainer" / "scheduler.pt", weights_only=True) == sched
    assert_same(load_file(str(tmp_path / "trainer" / "adapter_model.safetensors")), want)


@pytest.mark.parametrize("targets", [ALL, ["q_proj", "v_proj"]], ids=["all-linear", "peft-default"])
def test_neuron_peft_model_loads_the_consolidated_adapter_and_would_save_what_ckpt_wrote(
    targets, tmp_path
) -> None:
    """optimum-neuron's ``NeuronPeftModel.from_pretrained`` on its own model class (TP 1, one gloo rank) loads the
    consolidated adapter; what its save would hand NxD's ``save_checkpoint`` (``get_peft_model_state_dict``) equals
    ckpt's rank file tensor for tensor, and its ``create_parameter_metadata`` equals ckpt's metadata (parameters;
    the specs of the adapted modules, which are the ones its consolidation uses).  Its save lists an unadapted fused
    module's spec too (``peft_type`` None); its consolidation would then look for that module's base weight in the
    adapter shards, so ckpt leaves those out."""
    from _one_rank import one_rank
    from optimum.neuron.models.training.checkpointing import xser_load_on_cpu
    from transformers import LlamaConfig

    cfg = llama_config(2)
    want = peft_adapter(tmp_path / "peft", cfg, targets, shared_a=True)
    convert(tmp_path / "peft", tmp_path / "on", cfg, "optimum-neuron", tp=1)
    tag = tmp_path / "on" / "adapter_default" / "adapter_shards"
    assert_same(consolidate(tmp_path / "on", tmp_path / "cons"), want)
    shutil.copy(tag.parent / "adapter_config.json", tmp_path / "cons" / "adapter_config.json")
    mine = json.loads((tag / "mp_metadata_pp_rank_0.json").read_text())
    written = xser_load_on_cpu(str(tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
    with one_rank():
        from optimum.neuron.models.training import (
            LlamaForCausalLM,
            TrainingNeuronConfig,
            create_parameter_metadata,
        )
        from optimum.neuron.peft import NeuronPeftModel
        from optimum.neuron.peft.utils.save_and_load import get_peft_model_state_dict

        model = LlamaForCausalLM(LlamaConfig(**cfg), TrainingNeuronConfig(tensor_parallel_size=1))
        peft_model = NeuronPeftModel.from_pretrained(model, str(tmp_path / "cons"))
        assert_same(get_peft_model_state_dict(peft_model), written)
        own = json.loads(json.dumps(create_parameter_metadata(peft_model)))
    assert {k: v for k, v in own["parameters"].items() if ".lora_" in k} == mine["parameters"]
    lora_specs = [
        {**m, "specs": [s for s in m["specs"] if s[1]["peft_type"] == "lora"]}
        for m in own["model_weight_transformation_specs"]
    ]
    assert [m for m in lora_specs if m["specs"]] == mine["model_weight_transformation_specs"]
    if "gate_proj" not in targets:  # why: with its own metadata its consolidation fails on the unadapted MLP
        (tag / "mp_metadata_pp_rank_0.json").write_text(json.dumps(own))
        with pytest.raises(KeyError, match="mlp.gate_up_proj.weight"):
            consolidate(tmp_path / "on", tmp_path / "cons2")


def test_neuron_peft_model_on_two_tp_ranks_holds_what_ckpt_wrote_for_each_rank(tmp_path) -> None:
    """At TP 2 (one gloo process per rank), ``NeuronPeftModel.from_pretrained`` lays the consolidated adapter out over
    optimum-neuron's parallel LoRA layers (``adapt_state_dict``: its own GQA query permutation and KV replication),
    for a GQA model (1 KV head: ``GQAQKVColumnParallelLinear``, ``kv_size_multiplier`` 2) and one with separate
    q/k/v (2 KV heads); each rank then holds exactly the rank file ckpt wrote for it, except where its loading
    itself rounds (the mean of the three equal ``lora_A`` of a GQA ``qkv_proj``, found here)."""
    from _peft_load_ranks import run
    from optimum.neuron.models.training.checkpointing import xser_load_on_cpu
    from ranks import run_ranks

    cases, tags = [], []
    for kv in (1, 2):
        cfg, d = llama_config(kv), tmp_path / f"kv{kv}"
        peft_adapter(d / "peft", cfg, ALL, shared_a=True)
        convert(d / "peft", d / "on", cfg, "optimum-neuron", tp=2)
        consolidate(d / "on", d / "cons")
        tag = d / "on" / "adapter_default" / "adapter_shards"
        shutil.copy(tag.parent / "adapter_config.json", d / "cons" / "adapter_config.json")
        cases.append((cfg, str(d / "cons")))
        tags.append(tag)
    for r in run_ranks(run, 2, cases):
        for tag, state in zip(tags, r["states"], strict=True):
            written = xser_load_on_cpu(str(tag / "model" / f"dp_rank_00_tp_rank_{r['tp']:02d}_pp_rank_00.pt"))
            assert sorted(state) == sorted(written)
            for name, t in written.items():
                got = state[name]
                if name.endswith("qkv_proj.lora_A.weight"):
                    # its GQA loading keeps mean(A_q, A_k, A_v): of three equal tensors, (a + a + a) / 3, which
                    # rounds some elements by one unit; ckpt's file holds the adapter's own lora_A
                    assert torch.equal(got, torch.stack([t, t, t]).mean(0)), name
                else:
                    assert torch.equal(got, t), name
