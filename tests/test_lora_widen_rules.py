"""The widening's rules without NxD processes (tests/test_lora_widen.py runs NxD's own modules): every PEFT config
PEFT users write (PEFT's default q/v, all-linear, rsLoRA, rank_pattern/alpha_pattern) becomes an NxD tag whose every
layer computes, per HF module, exactly PEFT's ``scaling * B @ A`` (added fused parts: exactly zero); PP stage files are
the TP files split by layer; the way back is bit-exact, or exactly wider once the off-diagonal blocks hold values;
``--merge-lora`` equals ``merge_and_unload()``; what one NxD scaling cannot express is refused in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from ckpt.cli.main import cli
from ckpt.converters.convert import convert
from ckpt.converters.lora import peft_delta
from ckpt.converters.lora_widen import rank_and_alpha
from ckpt.converters.options import ConvertOptions, load_config
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt.errors import LayoutError
from ckpt.layouts import bit_equal
from ckpt.layouts.lora import nxd_to_adapter
from ckpt.layouts.spec import LayoutSpec
from tests._lora_models import save, tiny_config

pytest.importorskip("peft")
PREFIX = "base_model.model."


def _peft(root: Path, seed: int = 0, steps: int = 2, **lora):  # noqa: ANN003, ANN202
    """A tiny Llama + ``LoraConfig(**lora)`` (PEFT's defaults otherwise), ``steps`` AdamW steps so lora_B is
    non-zero; ``(model, base_dir, adapter_dir, config)``; also saved adapter-only with the AdamW state in
    ``root/ckpt``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_config(tiny_config("llama")), LoraConfig(**lora))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for s in range(steps):
        ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(s))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    base, adapter = save(model, root)
    if steps:
        import ckpt

        ckpt.save(
            str(root / "ckpt"), step=steps, model=model, optimizer=opt, adapter_only=True, base_source="t"
        )
    return model, base, adapter, load_config(str(base))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {
        k.removeprefix(PREFIX): v for k, v in load_file(str(folder / "adapter_model.safetensors")).items()
    }


def _raw(tag: Path, spec: LayoutSpec) -> tuple[dict[str, torch.Tensor], float]:
    """The tag's LoRA tensors as NxD's layers hold them (HF names, rank R, no narrowing) and NxD's scaling."""
    import math

    shards, cfg = {}, None
    for f in sorted((tag / "model").glob("*.pt")):
        sd = torch.load(f, weights_only=True)
        cfg = sd.pop("lora_config")
        tp, pp = int(f.stem.split("_")[5]), int(f.stem.split("_")[8])
        shards[(tp, pp)] = sd
    assert cfg is not None
    r = cfg["lora_rank"]
    return nxd_to_adapter(shards, spec), cfg["lora_alpha"] / (math.sqrt(r) if cfg["use_rslora"] else r)


def _check_exact(model, adapter: Path, tag: Path, spec: LayoutSpec) -> set[str]:  # noqa: ANN001
    """Every module's NxD delta (scaling * B_m @ A over the fused rank) is PEFT's (the layer's own scaling); the
    parts NxD adds are exactly zero.  Returns the modules NxD holds."""
    wide, s = _raw(tag, spec)
    ours = _tensors(adapter)
    mods = {n.rsplit(".lora_", 1)[0] for n in wide}
    for mod in mods:
        got = peft_delta(wide[f"{mod}.lora_A.weight"], wide[f"{mod}.lora_B.weight"], s)
        if f"{mod}.lora_A.weight" not in ours:
            assert not got.any(), mod
            continue
        layer = model.base_model.model.get_submodule(mod)
        want = peft_delta(
            ours[f"{mod}.lora_A.weight"], ours[f"{mod}.lora_B.weight"], layer.scaling["default"]
        )
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    return mods


def _back(tag: Path, dst: Path, cfg: dict) -> tuple[str, ...]:
    return convert(str(tag), str(dst), ConvertOptions(to="cuda", format="peft", config=cfg)).notes


def _same_folder(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and all(bit_equal(ta[k], tb[k]) for k in ta)
    assert json.loads((a / "adapter_config.json").read_text()) == json.loads(
        (b / "adapter_config.json").read_text()
    )


def test_peft_default_q_v_with_qkv_linear(tmp_path) -> None:
    """PEFT's default adapter (q_proj, v_proj) with --qkv-linear: k gets a zero lora_B block; back without k_proj;
    once k's block holds values it comes back as a k_proj adapter of the wider rank."""
    model, base, adapter, cfg = _peft(tmp_path)
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] in (["q_proj", "v_proj"],
                                                                                          ["v_proj", "q_proj"])  # fmt: skip
    spec = LayoutSpec.from_hf_config(cfg, tp=2, qkv_linear=True)
    r = CliRunner().invoke(cli, ["convert", str(adapter), str(tmp_path / "t"), "--to", "neuron", "--format", "nxd",
                                 "--tp", "2", "--qkv-linear", "--config", str(base / "config.json")])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert (
        "lora_rank 16, lora_alpha 16 (scaling 1.0 unchanged): fused qkv_proj (q_proj r8 + k_proj r0 + v_proj r8)"
        in r.output
    )
    assert _check_exact(model, adapter, tmp_path / "t", spec) == {
        f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv"
    }
    _back(tmp_path / "t", tmp_path / "b", cfg)
    _same_folder(adapter, tmp_path / "b")
    # with the AdamW state: k's added block gets zero moments in optim/, and q/v's come back bit for bit
    convert(str(tmp_path / "ckpt"), str(tmp_path / "to"), ConvertOptions.neuron(format="nxd", config=cfg, tp=2,
                                                                               qkv_linear=True))  # fmt: skip
    opt0 = torch.load(tmp_path / "to" / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    assert (
        len(opt0["state"]) == 2 * 4
    )  # per layer, NxD's order: qkv_proj lora_A, lora_B weight_q, weight_k, weight_v
    k0 = opt0["state"][2]
    assert (
        not k0["exp_avg"].any()
        and not k0["exp_avg_sq"].any()
        and torch.equal(k0["step"], opt0["state"][1]["step"])
    )
    assert opt0["state"][1]["exp_avg"].any()
    convert(
        str(tmp_path / "to"),
        str(tmp_path / "ck"),
        ConvertOptions(to="cuda", format="ckpt", config=cfg, step=2),
    )
    import ckpt

    ra, rb = ckpt.open_checkpoint(str(tmp_path / "ckpt")), ckpt.open_checkpoint(str(tmp_path / "ck"))
    ta = {n for n, t in ra.manifest.tensors.items() if t.role in ("parameter", "optimizer_state")}
    tb = {n for n, t in rb.manifest.tensors.items() if t.role in ("parameter", "optimizer_state")}
    assert ta == tb and len(ta) == 2 * 2 * 2 * 3 and all(bit_equal(ra.read(n), rb.read(n)) for n in ta)
    # fill k's block of layer 0 (as training on Trainium would) -> k_proj returns, exactly
    f = tmp_path / "t" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    sd = torch.load(f, weights_only=True)
    sd["model.layers.0.self_attn.qkv_proj.lora_B.weight_k"] = torch.randn(
        sd["model.layers.0.self_attn.qkv_proj.lora_B.weight_k"].shape
    )
    torch.save(sd, f)
    f1 = tmp_path / "t" / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt"
    sd1 = torch.load(f1, weights_only=True)
    sd1["model.layers.0.self_attn.qkv_proj.lora_B.weight_k"] = torch.randn(
        sd1["model.layers.0.self_attn.qkv_proj.lora_B.weight_k"].shape
    )
    torch.save(sd1, f1)
    notes = _back(tmp_path / "t", tmp_path / "w", cfg)
    assert "filled the off-diagonal blocks of qkv_proj in 1 layers: 1 modules return with rank 16" in notes[0]
    wcfg = json.loads((tmp_path / "w" / "adapter_config.json").read_text())
    assert "k_proj" in wcfg["target_modules"] and wcfg["rank_pattern"] == {
        "model.layers.0.self_attn.k_proj": 16
    }
    wide, s = _raw(tmp_path / "t", spec)
    got = _tensors(tmp_path / "w")
    k = "model.layers.0.self_attn.k_proj"
    assert bit_equal(got[f"{k}.lora_B.weight"], wide[f"{k}.lora_B.weight"])
    assert bit_equal(got[f"{k}.lora_A.weight"], wide[f"{k}.lora_A.weight"])
    # PEFT loads it: layer 0's k_proj has the rank-16 adapter, the others' k_proj none (only layer 0 in the file)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "w")
    kl = loaded.base_model.model.model.layers[0].self_attn.k_proj
    assert kl.r["default"] == 16 and kl.scaling["default"] == s
    assert torch.equal(kl.lora_B["default"].weight, got[f"{k}.lora_B.weight"])


def test_all_linear_pp_stages_are_the_tp_files_split_by_layer(tmp_path) -> None:
    model, base, adapter, cfg = _peft(tmp_path, target_modules="all-linear")
    convert(str(adapter), str(tmp_path / "tp"), ConvertOptions.neuron(format="nxd", config=cfg, tp=2))
    convert(str(adapter), str(tmp_path / "pp"), ConvertOptions.neuron(format="nxd", config=cfg, tp=2, pp=2))
    for t in range(2):
        whole = torch.load(
            tmp_path / "tp" / "model" / f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt", weights_only=True
        )
        staged = {}
        for p in range(2):
            sd = torch.load(
                tmp_path / "pp" / "model" / f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt",
                weights_only=True,
            )
            assert sd.pop("lora_config") == whole["lora_config"]
            assert all(f"layers.{p}." in n for n in sd)
            staged |= sd
        whole.pop("lora_config")
        assert staged.keys() == whole.keys() and all(bit_equal(staged[k], whole[k]) for k in whole)
    _check_exact(model, adapter, tmp_path / "pp", LayoutSpec.from_hf_config(cfg, tp=2, pp=2))
    _back(tmp_path / "pp", tmp_path / "b", cfg)
    _same_folder(adapter, tmp_path / "b")


@pytest.mark.parametrize(
    "lora,rank",
    [
        (dict(target_modules="all-linear", use_rslora=True, lora_alpha=16), 24),
        (dict(target_modules="all-linear", r=8, lora_alpha=16, rank_pattern={"q_proj": 16}, alpha_pattern={"q_proj": 32}), 32),
        (dict(target_modules=["q_proj", "v_proj", "o_proj"], r=4, lora_alpha=8, rank_pattern={"o_proj": 12}, alpha_pattern={"o_proj": 24}), 12),
    ],
    ids=["rslora", "rank_pattern_q", "rank_pattern_o"],
)  # fmt: skip
def test_widened_configs_exact_and_back_bit_exact(tmp_path, lora, rank) -> None:  # noqa: ANN001
    model, base, adapter, cfg = _peft(tmp_path, **lora)
    spec = LayoutSpec.from_hf_config(cfg, tp=2, qkv_linear=True)
    r = convert(
        str(adapter),
        str(tmp_path / "t"),
        ConvertOptions.neuron(format="nxd", config=cfg, tp=2, qkv_linear=True),
    )
    assert f"lora_rank {rank}" in r.notes[0]
    tag_cfg = json.loads((tmp_path / "t" / "adapter_config.json").read_text())
    assert tag_cfg["lora_rank"] == rank and tag_cfg["ckpt_widened"]["lora_rank"] == rank
    _check_exact(model, adapter, tmp_path / "t", spec)
    _back(tmp_path / "t", tmp_path / "b", cfg)
    _same_folder(adapter, tmp_path / "b")
    # --merge-lora from the tag equals PEFT's merge_and_unload, bit for bit
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    convert(
        str(base), str(tmp_path / "m"), ConvertOptions(to="cuda", format="hf", merge_lora=str(tmp_path / "t"))
    )
    got = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert got.keys() == want.keys() and all(bit_equal(got[k], want[k]) for k in got)


def test_different_scalings_refused_in_one_line(tmp_path) -> None:
    _, base, adapter, cfg = _peft(tmp_path, target_modules="all-linear", rank_pattern={"q_proj": 16})
    r = CliRunner().invoke(cli, ["convert", str(adapter), str(tmp_path / "t"), "--to", "neuron", "--format", "nxd",
                                 "--tp", "2", "--config", str(base / "config.json")])  # fmt: skip
    assert r.exit_code == 2
    line = r.output.strip()
    assert "\n" not in line and "has scaling 0.5" in line and "has 1.0" in line and "one scaling" in line
    assert not (tmp_path / "t").exists()
    # PEFT and --merge-lora hold it as it is
    convert(str(adapter), str(tmp_path / "p"), ConvertOptions(to="cuda", format="peft"))
    _same_folder(adapter, tmp_path / "p")


@pytest.mark.parametrize("lora,key", [(dict(use_dora=True), "use_dora"), (dict(modules_to_save=["lm_head"]), "modules_to_save"),
                                      (dict(bias="lora_only"), "bias")])  # fmt: skip
def test_dora_modules_to_save_bias_refused(tmp_path, lora, key) -> None:  # noqa: ANN001
    _, base, adapter, cfg = _peft(tmp_path, steps=0, target_modules="all-linear", **lora)
    with pytest.raises(LayoutError, match=key):
        convert(str(adapter), str(tmp_path / "t"), ConvertOptions.neuron(format="nxd", config=cfg, tp=2))
    assert not (tmp_path / "t").exists()


def test_merge_lora_all_linear_and_trained_wide(tmp_path) -> None:
    """--merge-lora with an all-linear PEFT folder, and with a widened tag whose off-diagonal blocks hold values (the
    wide PEFT adapter it returns as): both equal PEFT's merge_and_unload() bit for bit."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, base, adapter, cfg = _peft(tmp_path, target_modules="all-linear")
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    convert(str(base), str(tmp_path / "m"), ConvertOptions(to="cuda", format="hf", merge_lora=str(adapter)))
    got = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert got.keys() == want.keys() and all(bit_equal(got[k], want[k]) for k in got)
    convert(str(adapter), str(tmp_path / "t"), ConvertOptions.neuron(format="nxd", config=cfg, tp=2))
    for f in (tmp_path / "t" / "model").glob("*.pt"):  # "train" the off-diagonal blocks of gate_up_proj
        sd = torch.load(f, weights_only=True)
        for n in sd:
            if n.endswith("gate_up_proj.lora_B.weight"):
                sd[n] = sd[n] + 0.01 * torch.randn(
                    sd[n].shape, generator=torch.Generator().manual_seed(len(n))
                )
        torch.save(sd, f)
    _back(tmp_path / "t", tmp_path / "w", cfg)
    # re-laid out for another TP, the wide adapter is not widened twice: gate/up share their (equal) lora_A block
    convert(str(tmp_path / "t"), str(tmp_path / "t1"), ConvertOptions.neuron(format="nxd", config=cfg, tp=1))
    assert json.loads((tmp_path / "t1" / "adapter_config.json").read_text())["lora_rank"] == 16
    _back(tmp_path / "t1", tmp_path / "w1", cfg)
    _same_folder(tmp_path / "w", tmp_path / "w1")
    wide = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "w")
    assert wide.base_model.model.model.layers[0].mlp.up_proj.r["default"] == 16
    want = wide.merge_and_unload().state_dict()
    convert(
        str(base),
        str(tmp_path / "m2"),
        ConvertOptions(to="cuda", format="hf", merge_lora=str(tmp_path / "t")),
    )
    got = load_file(str(tmp_path / "m2" / "model.safetensors"))
    assert got.keys() == want.keys() and all(bit_equal(got[k], want[k]) for k in got)


def test_rank_and_alpha_keep_the_scaling_exactly() -> None:
    """An NxD rank (at least the widened one; a little more zero padding where rsLoRA's alpha / sqrt(rank) cannot
    hit the scaling) and alpha keeping PEFT's scaling to the last bit, for the alphas and ranks PEFT users pick."""
    import math

    padded = 0
    for alpha in (1, 8, 16, 32, 64, 7):
        for r in (1, 4, 8, 16, 64):
            for rs in (False, True):
                s = alpha / (math.sqrt(r) if rs else r)
                for least in range(1, 200):
                    rank, a = rank_and_alpha(s, least, rs)
                    assert a / (math.sqrt(rank) if rs else rank) == s and least <= rank <= least + 4, (
                        alpha,
                        r,
                        least,
                        rs,
                    )
                    padded += rank > least
                    if not rs:
                        assert rank == least and a == alpha * least / r
    assert 0 < padded < 500
