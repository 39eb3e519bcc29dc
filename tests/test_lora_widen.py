"""LoRA adapters as PEFT users train them (``LoraConfig(target_modules="all-linear")``, PEFT's defaults: r 8,
alpha 8, an independent ``lora_A`` per module, ``lora_B`` zero-initialised, then trained a few steps with AdamW on the
CPU) -> NxD LoRA tags in every layout: widened exactly onto NxD's fused layers (``converters/lora_widen.py``).

NxD's own LoRA modules (the vendored NxD 2.29 source on CPU gloo ranks, ``tests/_lora_nxd_modules.py``) load the
tag with ``strict=True`` and the ``LoraConfig`` NxD reads from it, and give PEFT's logits and loss; one more AdamW
step on NxD's modules from the tag's ``optim/`` state moves every original block exactly as PEFT's next step does
(moments carried), and fills the off-diagonal blocks, which then come back as an exact wider-rank PEFT adapter.
Untrained, the tag comes back to the original PEFT adapter and optimizer state bit for bit."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from ckpt.cli.main import cli
from ckpt.converters.convert import convert
from ckpt.converters.options import ConvertOptions, load_config
from click.testing import CliRunner
from safetensors.torch import load_file

import ckpt
from ckpt.layouts import bit_equal, full_state_to_nxd, gqa
from ckpt.layouts.spec import LayoutSpec
from tests._lora_models import save, tiny_config
from tests.conftest import run_ranks

pytest.importorskip("peft")

#: layout -> (KV heads of the tiny Llama, flags).  One KV head lets TP 2 replicate it (kv_size_multiplier 2) on trn1
#: and trn2 with two processes.  NxD's LoraGQAQKVParallelLinear cannot train with fuse_qkv (it adds in place to the
#: views its fused base layer returns, which autograd refuses), so the fused layout is checked forward only.
LAYOUTS = {
    "tp2": (2, dict(tp=2)),
    "tp2_qkv_m2_trn2": (1, dict(tp=2, qkv_linear=True, kv_size_multiplier=2, hw="trn2")),
    "tp2_qkv_m2_trn1_fused": (1, dict(tp=2, qkv_linear=True, kv_size_multiplier=2, fuse_qkv=True)),
}
PREFIX = "base_model.model."


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(seed))


def _step(model, opt, ids) -> float:  # noqa: ANN001
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


@pytest.fixture(scope="module")
def models(tmp_path_factory):  # noqa: ANN201
    made: dict[int, dict] = {}

    def get(kv: int) -> dict:
        if kv not in made:
            made[kv] = _train(tmp_path_factory.mktemp(f"widen_kv{kv}"), kv)
        return made[kv]

    return get


@pytest.fixture(scope="module")
def trained(models):  # noqa: ANN001, ANN201
    return models(2)


def _train(root: Path, kv: int) -> dict:
    """A tiny Llama (``kv`` KV heads) + PEFT's all-linear LoRA with PEFT's defaults, 3 AdamW steps on the CPU; saved
    as a PEFT folder and as an adapter checkpoint of ours (with the AdamW state); and what PEFT's next step gives."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("llama")
    config.num_key_value_heads = kv
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(target_modules="all-linear"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for s in range(3):
        _step(model, opt, _ids(s))
    base, adapter = save(model, root)
    ckpt.save(
        str(root / "ckpt_adapter"), step=3, model=model, optimizer=opt, adapter_only=True, base_source="tiny"
    )
    ids = _ids(3)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    nxt = copy.deepcopy(model).train()
    nopt = torch.optim.AdamW([p for p in nxt.parameters() if p.requires_grad], lr=1e-2)
    nopt.load_state_dict(opt.state_dict())
    _step(nxt, nopt, ids)
    after = {
        n.replace(".default", "").removeprefix(PREFIX): p.detach().clone()
        for n, p in nxt.named_parameters()
        if p.requires_grad
    }
    names = [n.replace(".default", "").removeprefix(PREFIX) for n, p in nxt.named_parameters() if p.requires_grad]
    moments = {names[pid]: st for pid, st in nopt.state_dict()["state"].items()}
    # the same step without the carried moments moves the blocks elsewhere
    fresh = copy.deepcopy(model).train()
    _step(fresh, torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2), ids)
    moved = {
        n.replace(".default", "").removeprefix(PREFIX): p.detach()
        for n, p in fresh.named_parameters()
        if p.requires_grad
    }
    assert max((after[n] - moved[n]).abs().max().item() for n in after) > 1e-3
    cos, sin = model.base_model.model.model.rotary_emb(torch.zeros(1), torch.arange(ids.shape[1])[None])
    return dict(model=model, base=base, adapter=adapter, ckpt=root / "ckpt_adapter", cfg=load_config(str(base)),
                ids=ids, logits=out.logits, loss=out.loss.item(), after=after, moments=moments, cos=cos[0], sin=sin[0])  # fmt: skip


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "adapter_model.safetensors"))


def _run_nxd(trained, layout: str, tag: Path, work: Path, nxd_src: str) -> list[dict]:  # noqa: ANN001
    flags = LAYOUTS[layout][1]
    spec = LayoutSpec.from_hf_config(trained["cfg"], **flags)
    work.mkdir()
    shutil.copytree(tag, work / "tag")
    (work / "config.json").write_text(json.dumps(trained["cfg"]))
    base = load_file(str(trained["base"] / "model.safetensors"))
    per_tp: dict[int, dict[str, torch.Tensor]] = {}
    for (t, _), sd in full_state_to_nxd(base, spec).items():
        per_tp.setdefault(t, {}).update(sd)
    for t, sd in per_tp.items():
        torch.save(sd, work / f"base_tp{t}.pt")
    replicated = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    job = {
        "ids": trained["ids"], "cos": trained["cos"], "sin": trained["sin"],
        "q_heads": [list(gqa.q_heads_of_rank(spec, r)) for r in range(spec.tp)],
        "kv_heads": [list(gqa.kv_heads_of_rank(spec, r)) for r in range(spec.tp)],
        "base": {k: v for k, v in base.items() if k in replicated or "layernorm" in k},
    }  # fmt: skip
    torch.save(job, work / "job.pt")
    from tests._lora_nxd_modules import rank_main

    paths = run_ranks(rank_main, spec.tp, nxd_src, str(work), flags, timeout=300)
    return [torch.load(p, weights_only=True) for p in paths]


def _flag_args(flags: dict) -> list[str]:
    out = []
    for k, v in flags.items():
        out += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return out


def _to_nxd(trained, flags: dict, tag: Path) -> dict:  # noqa: ANN001
    """``ckpt convert`` (the CLI) of the adapter checkpoint to an NxD tag; the tag's adapter_config.json."""
    r = CliRunner().invoke(cli, ["convert", str(trained["ckpt"]), str(tag), "--to", "neuron", "--format", "nxd",
                                 "--config", str(trained["base"] / "config.json"), *_flag_args(flags)])  # fmt: skip
    assert r.exit_code == 0, r.output
    rank = 24 if flags.get("qkv_linear") else 16
    assert f"LoRA widened for NxD to lora_rank {rank}, lora_alpha {rank} (scaling 1.0 unchanged)" in r.output
    tag_cfg = json.loads((tag / "adapter_config.json").read_text())
    assert tag_cfg["lora_rank"] == tag_cfg["ckpt_widened"]["lora_rank"] == rank
    assert (tag / "optim").is_dir()
    return tag_cfg


def _source(flags: dict) -> dict:
    return {k: v for k, v in flags.items() if k == "hw"}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_all_linear_adapter_on_nxd_lora_modules(models, layout, tmp_path, nxd_src) -> None:  # noqa: ANN001
    kv, flags = LAYOUTS[layout]
    trained = models(kv)
    cfg = trained["cfg"]
    tag = tmp_path / "tag"
    tag_cfg = _to_nxd(trained, flags, tag)

    outs = _run_nxd(trained, layout, tag, tmp_path / "work", nxd_src)
    for out in outs:  # NxD's modules give PEFT's logits and loss (fp32; TP sums in another order)
        torch.testing.assert_close(out["logits"], trained["logits"], rtol=1e-5, atol=1e-5)
        assert abs(out["loss"] - trained["loss"]) < 1e-5
    if "logits_after" in outs[0]:
        _check_trained_on_nxd(trained, flags, tag, tag_cfg, outs, tmp_path)

    # untrained: back to the original PEFT adapter bit for bit, and its AdamW state too
    back = tmp_path / "back"
    r = convert(
        str(tag), str(back), ConvertOptions(to="cuda", format="peft", config=cfg, source_flags=_source(flags))
    )
    assert r.notes == (
        "LoRA: NxD's widened layers returned to the original PEFT adapter (off-diagonal blocks are zero)",
    )
    want, have = _tensors(trained["adapter"]), _tensors(back)
    assert have.keys() == want.keys() and all(bit_equal(have[k], want[k]) for k in want)
    recorded = ckpt.open_checkpoint(str(trained["ckpt"])).manifest.adapter["lora"]["peft"]
    assert json.loads((back / "adapter_config.json").read_text()) == json.loads(json.dumps(recorded))
    convert(str(tag), str(tmp_path / "ck"), ConvertOptions(to="cuda", format="ckpt", config=cfg, step=3,
                                                          source_flags=_source(flags)))  # fmt: skip
    _same_optimizer(trained["ckpt"], tmp_path / "ck")


def _check_trained_on_nxd(trained, flags, tag, tag_cfg, outs, tmp_path) -> None:  # noqa: ANN001
    """After one AdamW step on NxD's modules (from the tag's optim/ state): every original block moved as PEFT's own
    next step moved it; the off-diagonal blocks trained; back to PEFT as an exact wider adapter."""
    for out in outs:
        torch.testing.assert_close(out["logits_after"], outs[0]["logits_after"], rtol=0, atol=1e-6)
    after = tmp_path / "after"
    shutil.copytree(tmp_path / "work" / "after", after)
    for f in ("adapter_config.json", "checkpoint", "done"):
        shutil.copy(tag / f, after / f)
    wide = tmp_path / "wide"
    source = [a for k, v in _source(flags).items() for a in ("--source-hw", v)]
    r = CliRunner().invoke(cli, ["convert", str(after), str(wide), "--to", "cuda", "--format", "peft",
                                 "--config", str(trained["base"] / "config.json"), *source])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "training on NxD filled the off-diagonal blocks of gate_up_proj" in r.output
    got, wide_cfg = _tensors(wide), json.loads((wide / "adapter_config.json").read_text())
    for mod, m in tag_cfg["ckpt_widened"]["modules"].items():
        a, b = got[f"{PREFIX}{mod}.lora_A.weight"], got[f"{PREFIX}{mod}.lora_B.weight"]
        fused = mod.endswith(("gate_proj", "up_proj")) or (flags.get("qkv_linear") and mod.endswith(("q_proj", "k_proj", "v_proj")))  # fmt: skip
        assert wide_cfg["rank_pattern"].get(mod, 8) == (
            8 * (3 if "self_attn" in mod else 2) if fused else 8
        ), mod
        lo = m["offset"] if fused else 0
        # the original blocks moved exactly as PEFT's own next step moved them (the AdamW moments were carried)
        torch.testing.assert_close(
            a[lo : lo + 8], trained["after"][f"{mod}.lora_A.weight"], rtol=0, atol=2e-6
        )
        torch.testing.assert_close(
            b[:, lo : lo + 8], trained["after"][f"{mod}.lora_B.weight"], rtol=0, atol=2e-6
        )
        if fused:
            assert b[:, :lo].abs().sum() + b[:, lo + 8 :].abs().sum() > 0, (
                mod
            )  # the off-diagonal blocks trained
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained["base"]), wide).eval()
    with torch.no_grad():
        got_logits = loaded(input_ids=trained["ids"]).logits
    torch.testing.assert_close(got_logits, outs[0]["logits_after"], rtol=1e-5, atol=1e-5)
    # NxD's optimizer state after the step comes back with the wide tensors: in the original blocks, PEFT's moments
    from ckpt.converters.nxd.lora import read_lora_tag

    ad, _ = read_lora_tag(str(after), config=trained["cfg"], source_flags=_source(flags))
    assert ad.optimizer is not None
    for mod, m in tag_cfg["ckpt_widened"]["modules"].items():
        lo = m["offset"] if wide_cfg["rank_pattern"].get(mod) else 0
        for ab, dim in (("A", 0), ("B", 1)):
            name = f"{mod}.lora_{ab}.weight"
            st, want = ad.optimizer["state"][name], trained["moments"][name]
            assert st["exp_avg"].shape == ad.tensors[name].shape and torch.equal(st["step"], want["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(st[key].narrow(dim, lo, 8), want[key], rtol=1e-3, atol=1e-9)
    convert(str(after), str(tmp_path / "ck_after"), ConvertOptions(to="cuda", format="ckpt", config=trained["cfg"],
                                                                  step=4, source_flags=_source(flags)))  # fmt: skip


def _same_optimizer(a: Path, b: Path) -> None:
    ra, rb = ckpt.open_checkpoint(str(a)), ckpt.open_checkpoint(str(b))
    ma, mb = ra.manifest, rb.manifest
    ta = {n: t for n, t in ma.tensors.items() if t.role in ("parameter", "optimizer_state")}
    tb = {n: t for n, t in mb.tensors.items() if t.role in ("parameter", "optimizer_state")}
    assert ta.keys() == tb.keys() and len(ta) == 3 * 14 * 2
    for n in ta:
        assert bit_equal(ra.read(n), rb.read(n)), n


def test_peft_back_bit_exact_same_logits(trained, tmp_path) -> None:  # noqa: ANN001
    """PEFT folder -> widened tag (qkv_linear, the widest) -> PEFT folder: the same bytes, PeftModel's logits identical."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = trained["cfg"]
    convert(str(trained["adapter"]), str(tmp_path / "t"), ConvertOptions.neuron(format="nxd", config=cfg, tp=2,
                                                                               qkv_linear=True))  # fmt: skip
    # the same rank files as from the adapter checkpoint (which holds the same tensors)
    convert(str(trained["ckpt"]), str(tmp_path / "t2"), ConvertOptions.neuron(format="nxd", config=cfg, tp=2,
                                                                              qkv_linear=True))  # fmt: skip
    for f in (tmp_path / "t" / "model").glob("*.pt"):
        a, b = (
            torch.load(f, weights_only=True),
            torch.load(tmp_path / "t2" / "model" / f.name, weights_only=True),
        )
        assert a.keys() == b.keys() and all(bit_equal(a[k], b[k]) for k in a if k != "lora_config")
    r = convert(
        str(tmp_path / "t"), str(tmp_path / "b"), ConvertOptions(to="cuda", format="peft", config=cfg)
    )
    assert r.notes == (
        "LoRA: NxD's widened layers returned to the original PEFT adapter (off-diagonal blocks are zero)",
    )
    want, have = _tensors(trained["adapter"]), _tensors(tmp_path / "b")
    assert have.keys() == want.keys() and all(bit_equal(have[k], want[k]) for k in want)
    assert json.loads((tmp_path / "b" / "adapter_config.json").read_text()) == json.loads(
        (trained["adapter"] / "adapter_config.json").read_text()
    )
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(trained["base"]), tmp_path / "b"
    ).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=trained["ids"]).logits, trained["logits"])
