"""LoRA adapters across stacks: PEFT folder -> NxD LoRA tag (TP/PP/qkv_linear) -> PEFT folder, bit-exact, loaded by
``PeftModel.from_pretrained`` with the original logits; each NxD rank's shards compute what NxD's LoRA layers compute
(``modules/lora/tp_layer.py`` semantics); ``--merge-lora`` equals ``merge_and_unload()``; what NxD cannot hold is
refused with one line and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt.cli.main import cli
from ckpt.converters.convert import convert
from ckpt.converters.lora import peft_delta
from ckpt.converters.nxd.lora import read_lora_tag
from ckpt.converters.options import ConvertOptions, load_config
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt.errors import LayoutError
from ckpt.layouts import bit_equal, full_state_to_nxd
from ckpt.layouts.lora import adapter_to_nxd, lora_placements, nxd_to_adapter
from ckpt.layouts.names import hf_to_nxd_name
from ckpt.layouts.spec import LayoutSpec
from ckpt.safe_unpickle import load_torch_file
from tests._lora_models import build, logits, save

pytest.importorskip("peft")

LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2_pp2": dict(tp=2, pp=2),
    "tp4_qkv_m2_trn1": dict(tp=4, qkv_linear=True, kv_size_multiplier=2),
    "tp4_qkv_m2_trn2_fused": dict(tp=4, qkv_linear=True, kv_size_multiplier=2, hw="trn2", fuse_qkv=True),
    "tp2_qkv": dict(tp=2, qkv_linear=True),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tmp_path_factory):  # noqa: ANN001, ANN201
    """A PEFT model whose q/k/v and gate/up lora_A are shared (so every NxD layout can hold it), saved."""
    model = build(request.param, shared=("mlp", "qkv"), seed=3 if request.param == "llama" else 5)
    root = tmp_path_factory.mktemp(request.param)
    base, adapter = save(model, root)
    return request.param, model, base, adapter, load_config(str(base))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_peft_nxd_peft_bit_exact_and_same_logits(case, layout, tmp_path) -> None:  # noqa: ANN001
    family, model, base, adapter, cfg = case
    tag, back = tmp_path / "tag", tmp_path / "back"
    convert(str(adapter), str(tag), ConvertOptions.neuron(format="nxd", config=cfg, **LAYOUTS[layout]))
    tp = LAYOUTS[layout]["tp"]
    pp = LAYOUTS[layout].get("pp", 1)
    assert len(list((tag / "model").glob("dp_rank_00_tp_rank_*_pp_rank_*.pt"))) == tp * pp
    assert (tag / "done").is_file()
    source_flags = {k: v for k, v in LAYOUTS[layout].items() if k == "hw"}
    convert(
        str(tag), str(back), ConvertOptions(to="cuda", format="peft", config=cfg, source_flags=source_flags)
    )
    a, b = _tensors(adapter), _tensors(back)
    assert set(a) == set(b) and all(bit_equal(a[k], b[k]) for k in a)
    assert json.loads((back / "adapter_config.json").read_text()) == json.loads(
        (adapter / "adapter_config.json").read_text()
    )
    if layout in (
        "tp2",
        "tp4_qkv_m2_trn2_fused",
    ):  # loading is slow-ish; two layouts prove the folder is PEFT's
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), back)
        assert torch.equal(logits(loaded), logits(model))


def test_tag_is_what_nxd_load_checkpoint_reads(case, tmp_path) -> None:  # noqa: ANN001
    """Rank files: NxD module names only, plus lora_config (save_lora_config_adapter=True form), which is what
    LoraModel.load_checkpoint pops before load_state_dict(strict=False)."""
    _, _, _, adapter, cfg = case
    tag = tmp_path / "tag"
    convert(str(adapter), str(tag), ConvertOptions.neuron(format="nxd", config=cfg, tp=4, qkv_linear=True,
                                                          kv_size_multiplier=2))  # fmt: skip
    sd = load_torch_file(tag / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt")
    lc = sd.pop("lora_config")
    assert lc["lora_rank"] == lc["r"] == 4 and lc["save_lora_config_adapter"] is True
    assert sorted(lc["target_modules"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    l0 = {
        k.removeprefix("model.layers.0."): tuple(v.shape)
        for k, v in sd.items()
        if k.startswith("model.layers.0.")
    }
    # hidden 64, heads 8 x hd 8, kv 2 x m 2 slots over tp 4 -> 1 KV head per rank; inter 96 -> 24 per rank
    assert l0 == {
        "self_attn.qkv_proj.lora_A.weight": (4, 64),
        "self_attn.qkv_proj.lora_B.weight_q": (16, 4),
        "self_attn.qkv_proj.lora_B.weight_k": (8, 4),
        "self_attn.qkv_proj.lora_B.weight_v": (8, 4),
        "self_attn.o_proj.lora_A.weight": (4, 16),
        "self_attn.o_proj.lora_B.weight": (64, 4),
        "mlp.gate_up_proj.lora_A.weight": (4, 64),
        "mlp.gate_up_proj.lora_B.weight": (48, 4),
        "mlp.down_proj.lora_A.weight": (4, 24),
        "mlp.down_proj.lora_B.weight": (64, 4),
    }


def _rank_weights(base_nxd, lora_nxd, spec, scaling):  # noqa: ANN001, ANN202
    """Effective weight of every adapted NxD layer on every rank, as NxD's LoRA layers compute their output:
    column (``LoraParallelLinear`` over ``ColumnParallelLinear``, ``LoraGQAQKVParallelLinear``):
    ``W_r x + s * B_r (A x)``; row (``RowParallelLinear``): ``sum_r W_r x_r + s * B (A_r x_r)``."""
    out = {}
    for rank, sd in lora_nxd.items():
        for name, t in sd.items():
            mod, ab, leaf = (
                name.rpartition(".lora_")[0],
                name.rpartition(".lora_")[2][0],
                name.rsplit(".", 1)[1],
            )
            if ab == "A":
                continue
            a = sd[f"{mod}.lora_A.weight"]
            base_name = f"{mod}.{leaf}" if not mod.endswith(("o_proj", "down_proj")) else f"{mod}.weight"
            w = base_nxd[rank][base_name]
            out[(rank, base_name)] = w + peft_delta(a, t, scaling)
    return out


@pytest.mark.parametrize("layout", ["tp2_pp2", "tp4_qkv_m2_trn1", "tp4_qkv_m2_trn2_fused"])
def test_nxd_layers_holding_the_shards_compute_the_merged_model(case, layout) -> None:  # noqa: ANN001
    """NxD's LoRA modules cannot run here (their parallel layers need Neuron process groups); instead each rank's
    shards are combined exactly as ``tp_layer.py`` combines them, and must equal that rank's shard of the merged
    (W + s B A) model laid out by the base-model layout engine.  Summed over ranks for row-parallel layers this is
    the layer's output, so equality per rank is equality of the forward."""
    _, model, base, adapter, cfg = case
    spec = LayoutSpec.from_hf_config(cfg, **LAYOUTS[layout])
    ad = {k.removeprefix("base_model.model."): v for k, v in _tensors(adapter).items()}
    base_sd = load_file(str(base / "model.safetensors"))
    lora_nxd = adapter_to_nxd(ad, spec)
    base_nxd = full_state_to_nxd(base_sd, spec)
    merged = dict(base_sd)
    scaling = 8 / 4
    for k in ad:
        if k.endswith("lora_A.weight"):
            mod = k.removesuffix(".lora_A.weight")
            merged[f"{mod}.weight"] = base_sd[f"{mod}.weight"] + peft_delta(
                ad[k], ad[f"{mod}.lora_B.weight"], scaling
            )
    merged_nxd = full_state_to_nxd(merged, spec)
    eff = _rank_weights(base_nxd, lora_nxd, spec, scaling)
    assert {rank for rank, _ in eff} == set(spec.ranks)
    for (rank, name), w in eff.items():
        # B_r @ A and rows of B @ A are the same dot products (inner dim r); float32 summation order may differ
        assert torch.allclose(w, merged_nxd[rank][name], rtol=0, atol=1e-6), (rank, name)
    adapted = {hf_to_nxd_name(k.replace(".lora_A", ""), spec) for k in ad if "lora_A" in k}
    assert adapted == {n for _, n in eff}


def test_separate_q_k_v_a_widened_for_shared_a_layout(tmp_path) -> None:
    """Independent q/k/v lora_A (every PEFT adapter has them) with --qkv-linear: widened onto the shared-A layer
    (tests/test_lora_widen*.py check the arithmetic), and back bit-exact; the separate-projection layout holds it as it
    is (no widening of q/k/v, gate/up still fused)."""
    model = build("llama", shared=("mlp",), seed=11)
    base, adapter = save(model, tmp_path)
    cfg = load_config(str(base))
    r = convert(
        str(adapter),
        str(tmp_path / "t"),
        ConvertOptions.neuron(format="nxd", config=cfg, tp=2, qkv_linear=True),
    )
    assert (
        r.notes
        and "qkv_proj (q_proj r4 + k_proj r4 + v_proj r4)" in r.notes[0]
        and "lora_rank 12" in r.notes[0]
    )
    convert(str(adapter), str(tmp_path / "ok"), ConvertOptions.neuron(format="nxd", config=cfg, tp=2))
    assert "ckpt_widened" not in json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    for tag in ("t", "ok"):
        convert(
            str(tmp_path / tag),
            str(tmp_path / f"back_{tag}"),
            ConvertOptions(to="cuda", format="peft", config=cfg),
        )
        a, b = _tensors(adapter), _tensors(tmp_path / f"back_{tag}")
        assert set(a) == set(b) and all(bit_equal(a[k], b[k]) for k in a)


def test_separate_gate_up_a_widened(tmp_path) -> None:
    model = build("llama", shared=(), seed=12)
    base, adapter = save(model, tmp_path)
    r = CliRunner().invoke(cli, ["convert", str(adapter), str(tmp_path / "t"), "--to", "neuron", "--format", "nxd",
                                 "--tp", "2", "--config", str(base / "config.json")])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert (
        "LoRA widened for NxD to lora_rank 8, lora_alpha 16 (scaling 2.0 unchanged): fused gate_up_proj"
        in r.output
    )


def test_unknown_lora_target_refused() -> None:
    spec = LayoutSpec.from_hf_config(
        {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "vocab_size": 96, "intermediate_size": 96, "model_type": "llama"}, tp=2)  # fmt: skip
    with pytest.raises(LayoutError, match=r"lm_head: no LoRA layout rule"):
        lora_placements(spec, "lm_head.lora_A.weight", (4, 64))
    with pytest.raises(LayoutError, match=r"not a LoRA matrix"):
        lora_placements(spec, "model.layers.0.self_attn.q_proj.lora_magnitude_vector", (64,))
    with pytest.raises(
        LayoutError, match=r"q_proj\.lora_B\.weight has shape \[60, 4\] but the config implies \[64, 4\]"
    ):
        adapter_to_nxd({"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
                        "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(60, 4)}, spec)  # fmt: skip


def test_tampered_replica_refused(case) -> None:  # noqa: ANN001
    _, _, _, adapter, cfg = case
    spec = LayoutSpec.from_hf_config(cfg, tp=2)
    ad = {k.removeprefix("base_model.model."): v for k, v in _tensors(adapter).items()}
    shards = adapter_to_nxd(ad, spec)
    name = "model.layers.1.self_attn.o_proj.lora_B.weight"  # whole on every rank
    shards[(1, 0)][name] = shards[(1, 0)][name].clone()
    shards[(1, 0)][name][0, 0] += 1
    with pytest.raises(LayoutError, match=r"o_proj\.lora_B\.weight: the copy stored on .*\(1, 0\).* differs"):
        nxd_to_adapter(shards, spec)
    assert nxd_to_adapter(adapter_to_nxd(ad, spec), spec).keys() == ad.keys()


def test_merge_lora_equals_merge_and_unload(case, tmp_path) -> None:  # noqa: ANN001
    """From the PEFT folder and from the NxD tag: bit-identical to PEFT's merge on the CPU (same arithmetic)."""
    _, model, base, adapter, cfg = case
    tag = tmp_path / "tag"
    convert(str(adapter), str(tag), ConvertOptions.neuron(format="nxd", config=cfg, tp=2, qkv_linear=True))
    import copy

    want = copy.deepcopy(model).merge_and_unload().state_dict()
    for i, src in enumerate((adapter, tag)):
        dst = tmp_path / f"merged{i}"
        r = CliRunner().invoke(cli, ["convert", str(base), str(dst), "--to", "cuda", "--format", "hf",
                                     "--merge-lora", str(src)])  # fmt: skip
        assert r.exit_code == 0, r.output
        got = load_file(str(dst / "model.safetensors"))
        assert set(got) == set(want)
        assert all(bit_equal(got[k], want[k]) for k in got)
        assert (dst / "config.json").is_file()
    changed = [
        k
        for k in want
        if not torch.equal(want[k], load_file(str(base / "model.safetensors")).get(k, want[k]))
    ]
    assert len(changed) == 7 * 2


def test_merge_lora_bf16_matches_peft(tmp_path) -> None:
    model = build("llama", shared=("mlp",), dtype=torch.bfloat16, seed=21)
    base, adapter = save(model, tmp_path)
    import copy

    want = copy.deepcopy(model).merge_and_unload().state_dict()
    convert(str(base), str(tmp_path / "m"), ConvertOptions(to="cuda", format="hf", merge_lora=str(adapter)))
    got = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert all(bit_equal(got[k], want[k]) for k in got)


def test_merge_refuses_adapter_of_another_base(case, tmp_path) -> None:  # noqa: ANN001
    _, _, _, adapter, _ = case
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=96))  # fmt: skip
    small.save_pretrained(tmp_path / "small")
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "small"), str(tmp_path / "m"), "--to", "cuda",
                                 "--format", "hf", "--merge-lora", str(adapter)])  # fmt: skip
    assert r.exit_code == 2 and "trained on another base" in r.output
    assert not (tmp_path / "m").exists()


def test_nxd_tag_needs_config_and_reads_layout(case, tmp_path) -> None:  # noqa: ANN001
    _, _, _, adapter, cfg = case
    tag = tmp_path / "tag"
    convert(str(adapter), str(tag), ConvertOptions.neuron(format="nxd", config=cfg, tp=4, qkv_linear=True,
                                                          kv_size_multiplier=2))  # fmt: skip
    r = CliRunner().invoke(
        cli, ["convert", str(tag), str(tmp_path / "p"), "--to", "cuda", "--format", "peft"]
    )
    assert r.exit_code == 2 and "--config" in r.output
    got, spec = read_lora_tag(str(tag), config=cfg)
    assert (spec.tp, spec.qkv_linear, spec.kv_size_multiplier) == (4, True, 2)
    assert got.r == 4 and got.scaling == 2.0
    r = CliRunner().invoke(cli, ["convert", str(tag), str(tmp_path / "x"), "--to", "cuda", "--format", "hf",
                                 "--config", str(tmp_path / "nothing.json")])  # fmt: skip
    assert r.exit_code == 2


def test_adapter_missing_a_layer_refused_for_nxd(case, tmp_path) -> None:  # noqa: ANN001
    """NxD's LoraModel adapts every layer's target modules and refuses missing keys: a PEFT adapter restricted to
    some layers (layers_to_transform) has no NxD form."""
    from safetensors.torch import save_file

    _, _, _, adapter, cfg = case
    part = tmp_path / "part"
    part.mkdir()
    t = {k: v for k, v in _tensors(adapter).items() if ".layers.1." not in k}
    save_file(t, str(part / "adapter_model.safetensors"))
    (part / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    with pytest.raises(
        LayoutError,
        match=r"model\.layers\.1 has no mlp\.down_proj\.lora_A\.weight while model\.layers\.0 has",
    ):
        convert(str(part), str(tmp_path / "t"), ConvertOptions.neuron(format="nxd", config=cfg, tp=2))
    assert not (tmp_path / "t").exists()
    convert(str(part), str(tmp_path / "p"), ConvertOptions(to="cuda", format="peft"))  # PEFT holds it


def test_nxd_tag_forms_read_and_refused(case, tmp_path) -> None:  # noqa: ANN001
    """xser rank files (NxD's use_xser) read like plain ones; NxD's default merge_sharded_lora=True form (every rank
    the same gathered tensors) is named and refused; --dry-run writes nothing."""
    import shutil

    from ckpt.converters.nxd.xser import save_nxd_file

    from ckpt.storage import open_storage

    _, _, _, adapter, cfg = case
    tag = tmp_path / "tag"
    convert(str(adapter), str(tag), ConvertOptions.neuron(format="nxd", config=cfg, tp=2, qkv_linear=True))
    xs = tmp_path / "xser"
    shutil.copytree(tag, xs)
    st = open_storage(str(xs))
    for f in sorted((xs / "model").glob("*.pt")):
        obj = load_torch_file(f)
        f.unlink()
        save_nxd_file(obj, st, f"model/{f.name}", True)
    assert list((xs / "model").glob("*.pt.tensors"))
    a, _ = read_lora_tag(str(tag), config=cfg)
    b, _ = read_lora_tag(str(xs), config=cfg)
    assert a.tensors.keys() == b.tensors.keys() and all(
        bit_equal(a.tensors[k], b.tensors[k]) for k in a.tensors
    )
    gathered = tmp_path / "gathered"
    convert(
        str(adapter),
        str(tmp_path / "tp1"),
        ConvertOptions.neuron(format="nxd", config=cfg, tp=1, qkv_linear=True),
    )
    shutil.copytree(tmp_path / "tp1", gathered)
    rank0 = gathered / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    shutil.copy(rank0, gathered / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt")
    with pytest.raises(LayoutError, match="merge_sharded_lora=True"):
        read_lora_tag(str(gathered), config=cfg)
    r = CliRunner().invoke(cli, ["convert", str(adapter), str(tmp_path / "dry"), "--to", "neuron", "--format", "nxd",
                                 "--tp", "2", "--config", str(adapter.parent / "base"), "--dry-run"])  # fmt: skip
    assert r.exit_code == 0 and "plan: adapter" in r.output and not (tmp_path / "dry").exists()
