"""Adapter-only checkpoints of LoRA runs (PEFT in process; a plain-torch LoRA model in the spawned runs): only trainable tensors and their optimizer state are written, the
base is recorded by identity, a different base is refused naming both (also by ``restore_latest``, which must not
fall back and start from scratch), and a LoRA run resumed from adapter-only saves continues with bit-identical
losses (``check_continuation`` in fresh processes) and passes ``ckpt verify-resume``."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt.cli.main import cli
from click.testing import CliRunner

import ckpt
from ckpt.errors import BaseMismatchError, StateMismatchError
from ckpt.format.manifest import MANIFEST_NAME
from ckpt.resume.continuity import check_continuation
from tests._lora_models import build
from tests._lora_train import train_lora
from tests.conftest import run_ranks
from tests.manifest_schema import schema_errors

pytest.importorskip("peft")


def _opt(model):  # noqa: ANN001, ANN202
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _step(model, opt, seed: int) -> float:  # noqa: ANN001
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(seed))
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def test_adapter_only_save_holds_adapter_and_optimizer_only(tmp_path) -> None:
    model = build("llama", seed=1)
    opt = _opt(model)
    _step(model, opt, 0)
    ckpt.save(
        str(tmp_path / "a"), step=1, model=model, optimizer=opt, adapter_only=True, base_source="tiny/base"
    )
    ckpt.save(str(tmp_path / "full"), step=1, model=model, optimizer=opt)
    m = ckpt.open_checkpoint(str(tmp_path / "a")).manifest
    lora = {n for n, p in model.named_parameters() if p.requires_grad}
    params = {n for n, t in m.tensors.items() if t.role == "parameter"}
    assert params == lora and all("lora_" in n for n in params)
    assert {t.param for t in m.tensors.values() if t.role == "optimizer_state"} == lora
    base = m.adapter["base"]
    assert base["source"] == "tiny/base" and base["digest"].startswith("xxh3_128:")
    assert base["tensors"] == sum(1 for n in model.state_dict() if n not in lora)
    assert base["config"]["hidden_size"] == 64
    assert m.adapter["lora"]["peft"]["r"] == 4 and m.adapter["lora"]["peft"]["lora_alpha"] == 8
    full = ckpt.open_checkpoint(str(tmp_path / "full")).manifest
    assert full.adapter is None and "adapter" not in json.loads(
        (tmp_path / "full" / MANIFEST_NAME).read_text()
    )
    lora_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert 3 * lora_bytes <= m.total_bytes < 3 * lora_bytes + 64 * 1024  # adapter + 2 Adam moments + headers
    assert full.total_bytes - m.total_bytes >= base["bytes"]


def test_restore_checks_the_base(tmp_path) -> None:
    model = build("llama", seed=1)
    opt = _opt(model)
    _step(model, opt, 0)
    ckpt.save(
        str(tmp_path / "a"), step=1, model=model, optimizer=opt, adapter_only=True, base_source="tiny/base"
    )
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the same base (rebuilt from the same seed) and fresh adapters: restored exactly, base untouched
    same = build("llama", seed=1)
    with torch.no_grad():
        for p in same.parameters():
            if p.requires_grad:
                p.zero_()
    opt2 = _opt(same)
    r = ckpt.restore(str(tmp_path / "a"), model=same, optimizer=opt2)
    assert r.missing == [] and r.unexpected == []
    assert all(torch.equal(p, want[n]) for n, p in same.named_parameters())
    assert opt2.state_dict()["state"][0]["exp_avg"].abs().sum() > 0
    # another base: refused, naming both
    other = build("llama", seed=2)
    with pytest.raises(
        BaseMismatchError, match=r"trained on base tiny/base \(xxh3_128:\w+\), the model's base is"
    ):
        ckpt.restore(str(tmp_path / "a"), model=other, optimizer=_opt(other))
    # a base modified in place (same objects) is noticed too
    with torch.no_grad():
        next(p for p in same.parameters() if not p.requires_grad).add_(1)
    with pytest.raises(BaseMismatchError):
        ckpt.restore(str(tmp_path / "a"), model=same)
    ckpt.restore(str(tmp_path / "a"), model=same, check_base=False)
    with pytest.raises(StateMismatchError, match="no trainable parameter"):
        ckpt.save(
            str(tmp_path / "b"), step=1, model=torch.nn.Linear(2, 2).requires_grad_(False), adapter_only=True
        )


def test_restore_latest_does_not_fall_back_over_a_base_mismatch(tmp_path) -> None:
    model = build("llama", seed=1)
    mgr = ckpt.CheckpointManager(str(tmp_path / "run"))
    for step in (1, 2):
        mgr.save(step, model=model, adapter_only=True)
    mgr.close()
    other = build("llama", seed=2)
    mgr = ckpt.CheckpointManager(str(tmp_path / "run"))
    with pytest.raises(BaseMismatchError):
        mgr.restore_latest(model=other)
    assert mgr.restore_latest(model=build("llama", seed=1)) == 2
    mgr.close()


def test_lora_run_resumes_bit_identical_from_adapter_only_saves(tmp_path) -> None:
    result = check_continuation(train_lora, steps=6, split=3, workdir=tmp_path)
    result.assert_continuous()
    [ck] = list((tmp_path / "split" / "checkpoints").glob("step_*"))
    m = ckpt.open_checkpoint(str(ck)).manifest
    assert m.adapter is not None and all("lora_" in n for n, t in m.tensors.items() if t.role == "parameter")
    r = CliRunner().invoke(cli, ["verify-resume", str(tmp_path / "split")])
    assert r.exit_code == 0, r.output


def test_adapter_checkpoint_converts_to_peft_and_nxd(tmp_path) -> None:
    """A GPU LoRA run saved with ckpt (adapter-only) -> the PEFT folder PEFT itself would write, and -> an NxD tag."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    from tests._lora_models import logits, save

    model = build("qwen2", shared=("mlp", "qkv"), seed=8)
    base, _ = save(model, tmp_path / "hf")
    ckpt.save(str(tmp_path / "c"), step=5, model=model, adapter_only=True)
    r = CliRunner().invoke(
        cli, ["convert", str(tmp_path / "c"), str(tmp_path / "peft"), "--to", "cuda", "--format", "peft"]
    )
    assert r.exit_code == 0, r.output
    want = get_peft_model_state_dict(model)
    got = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["peft_type"] == "LORA"
    assert set(cfg["target_modules"]) == set(model.peft_config["default"].target_modules)
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "peft")
    assert torch.equal(logits(loaded), logits(model))
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "c"), str(tmp_path / "tag"), "--to", "neuron", "--format",
                                 "nxd", "--tp", "2", "--qkv-linear", "--config", str(base / "config.json")])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert (tmp_path / "tag" / "done").is_file()


def test_neuron_checkpointer_adapter_only_two_tp_ranks(tmp_path) -> None:
    """NxD LoRA parameters on 2 gloo TP ranks: split matrices by NxD's attributes, whole ones by the explicit LoRA
    rules; each rank's base shard has its own digest, and a different shard on one rank is refused there."""
    from tests._lora_neuron import save_and_restore

    res = run_ranks(save_and_restore, 2, str(tmp_path))
    assert all(r["same"] and r["opt"] for r in res)
    assert res[0]["refused"] is None and "nxd/base" in res[1]["refused"] and "rank 1" in res[1]["refused"]
    m = ckpt.open_checkpoint(str(tmp_path / "a")).manifest
    assert set(m.tensors) >= {"model.layers.0.self_attn.qkv_proj.lora_A.weight"}
    assert not any("base_layer" in n for n in m.tensors)
    t = m.tensors
    assert t["model.layers.0.self_attn.qkv_proj.lora_B.weight_q"].shape == (8, 2)
    assert t["model.layers.0.self_attn.o_proj.lora_A.weight"].shape == (2, 8)
    assert t["model.layers.0.self_attn.qkv_proj.lora_A.weight"].partition is None
    digests = m.adapter["base"]["rank_digests"]
    assert len(digests) == 2 and digests[0] != digests[1]


def test_inspect_names_the_base(tmp_path) -> None:
    model = build("llama", seed=1)
    ckpt.save(str(tmp_path / "a"), step=1, model=model, adapter_only=True, base_source="tiny/base")
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "a")])
    assert r.exit_code == 0 and "adapter only: base tiny/base xxh3_128:" in r.output.replace("\n", "")


def test_adapter_optimizer_state_through_nxd_tags(tmp_path) -> None:
    """A PEFT run's adapter-only checkpoint (AdamW moments + step) -> NxD LoRA tag TP2 qkv_linear (optim/ rank files,
    pids in NxD's LoraModel parameter order) -> NxD tag TP4 -> read back: every moment and step bit-identical."""
    from ckpt.converters.lora import read_any
    from ckpt.converters.options import ConvertOptions, RunOptions, load_config

    from ckpt.safe_unpickle import load_torch_file
    from tests._lora_models import save

    model = build("llama", shared=("mlp", "qkv"), seed=9)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params.values(), lr=1e-3)
    for _ in range(2):
        for p in params.values():
            p.grad = torch.randn_like(p)
        for (
            layer
        ) in model.base_model.model.model.layers:  # keep the NxD-shared lora_A identical (as NxD trains it)
            a = layer.self_attn.q_proj.lora_A["default"].weight
            for m in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                m.lora_A["default"].weight.grad = a.grad.clone()
            layer.mlp.up_proj.lora_A["default"].weight.grad = layer.mlp.gate_proj.lora_A[
                "default"
            ].weight.grad.clone()
        opt.step()
    base, _ = save(model, tmp_path / "hf")
    ckpt.save(str(tmp_path / "c"), step=2, model=model, optimizer=opt, adapter_only=True)
    cfg = load_config(str(base))
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "c"), str(tmp_path / "t2"), "--to", "neuron", "--format",
                                 "nxd", "--tp", "2", "--qkv-linear", "--config", str(base / "config.json")])  # fmt: skip
    assert r.exit_code == 0, r.output
    o = load_torch_file(tmp_path / "t2" / "optim" / "dp_rank_00_tp_rank_01_pp_rank_00.pt")
    assert o["param_groups"][0]["lr"] == 1e-3 and len(o["state"]) == 2 * 10  # 2 layers x 10 NxD LoRA tensors
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "t2"), str(tmp_path / "t4"), "--to", "neuron", "--format",
                                 "nxd", "--tp", "4", "--kv-size-multiplier", "2", "--config", str(base / "config.json")])  # fmt: skip
    assert r.exit_code == 0, r.output
    opts = ConvertOptions(to="cuda", format="peft", config=cfg)
    src, _ = read_any(str(tmp_path / "c"), opts, RunOptions())
    back, _ = read_any(str(tmp_path / "t4"), opts, RunOptions())
    assert set(back.optimizer["state"]) == set(src.optimizer["state"]) == set(src.tensors)
    for name, per in src.optimizer["state"].items():
        got = back.optimizer["state"][name]
        assert set(got) == set(per) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(got[k], per[k]) and got[k].dtype == per[k].dtype for k in per), name
    assert [g["params"] for g in back.optimizer["param_groups"]] != [] and {
        n for g in back.optimizer["param_groups"] for n in g["params"]} == set(src.tensors)  # fmt: skip


def _tie_shared_a_grads(model) -> None:  # noqa: ANN001
    """NxD holds one lora_A for q/k/v (qkv_proj) and for gate/up: its gradient is the sum of the modules' ones."""
    for layer in model.base_model.model.model.layers:
        for mods in (
            (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
            (layer.mlp.gate_proj, layer.mlp.up_proj),
        ):
            ws = [m.lora_A["default"].weight for m in mods]
            g = sum(w.grad for w in ws)
            for w in ws:
                w.grad = g.clone()


def _train(model, opt, steps) -> list[float]:  # noqa: ANN001
    losses = []
    for seed in steps:
        ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(seed))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        _tie_shared_a_grads(model)
        opt.step()
        losses.append(loss.item())
    return losses


def test_peft_run_resumes_bit_identical_through_an_nxd_lora_tag(tmp_path) -> None:
    """PEFT run (3 steps) -> adapter-only save -> NxD LoRA tag TP2 with optim/ files -> ``--format ckpt`` -> restore
    into a fresh PeftModel + AdamW: the next losses equal the uninterrupted run's bit for bit."""
    from tests._lora_models import save

    model = build("llama", shared=("mlp", "qkv"), seed=9)
    model.train()
    opt = _opt(model)
    _train(model, opt, range(3))
    base, _ = save(model, tmp_path / "hf")
    ckpt.save(str(tmp_path / "c"), step=3, model=model, optimizer=opt, adapter_only=True)
    want = _train(model, opt, range(3, 6))
    cfg = str(base / "config.json")
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "c"), str(tmp_path / "step_3"), "--to", "neuron",
                                 "--format", "nxd", "--tp", "2", "--config", cfg])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert (tmp_path / "step_3" / "optim" / "dp_rank_00_tp_rank_01_pp_rank_00.pt").is_file()
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "step_3"), str(tmp_path / "back"), "--to", "cuda",
                                 "--format", "ckpt", "--config", cfg])  # fmt: skip
    assert r.exit_code == 0, r.output
    m = ckpt.open_checkpoint(str(tmp_path / "back")).manifest
    assert m.step == 3 and m.adapter["base"]["digest"] is None and m.optimizer["type"] == "unknown"
    assert m.adapter["lora"]["peft"]["r"] == 4
    doc = json.loads((tmp_path / "back" / MANIFEST_NAME).read_text())
    assert schema_errors(doc) == []
    assert {n for n, t in m.tensors.items() if t.role == "parameter"} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "back")])
    assert r.exit_code == 0 and "base not recorded" in r.output.replace("\n", " ")
    fresh = build("llama", shared=("mlp", "qkv"), seed=9)
    fresh.train()
    opt2 = _opt(fresh)
    with pytest.warns(UserWarning, match="base is not recorded"):
        res = ckpt.restore(str(tmp_path / "back"), model=fresh, optimizer=opt2)
    assert res.missing == [] and res.unexpected == [] and res.step == 3
    assert _train(fresh, opt2, range(3, 6)) == want
    unresumed = build("llama", shared=("mlp", "qkv"), seed=9).train()
    opt3 = _opt(unresumed)
    with pytest.warns(UserWarning):
        ckpt.restore(str(tmp_path / "back"), model=unresumed)  # weights only: the moments are what differ
    assert _train(unresumed, opt3, range(3, 6)) != want


def test_nxd_lora_tag_to_ckpt_refusals(tmp_path) -> None:
    """No step anywhere -> refused naming --step; a Neuron layout flag for --format ckpt -> refused; ZeRO-1 LoRA
    optimizer files that do not hold together -> refused; nothing written at DST."""
    from ckpt.safe_unpickle import load_torch_file
    from tests._lora_models import save

    model = build("llama", shared=("mlp", "qkv"), seed=9)
    opt = _opt(model)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    base, adapter = save(model, tmp_path / "hf")
    cfg = str(base / "config.json")
    r = CliRunner().invoke(
        cli, ["convert", str(adapter), str(tmp_path / "x"), "--to", "cuda", "--format", "ckpt"]
    )
    assert r.exit_code == 2 and "--step" in r.output and not (tmp_path / "x").exists()
    r = CliRunner().invoke(cli, ["convert", str(adapter), str(tmp_path / "x"), "--to", "cuda", "--format", "ckpt",
                                 "--tp", "2", "--step", "1"])  # fmt: skip
    assert r.exit_code == 2 and "--tp" in r.output and not (tmp_path / "x").exists()
    r = CliRunner().invoke(cli, ["convert", str(adapter), str(tmp_path / "p"), "--to", "cuda", "--format", "ckpt",
                                 "--step", "7"])  # fmt: skip
    assert r.exit_code == 0, r.output  # a PEFT folder: the adapter, no optimizer state
    m = ckpt.open_checkpoint(str(tmp_path / "p")).manifest
    assert m.step == 7 and m.optimizer is None
    fresh = build("llama", shared=("mlp", "qkv"), seed=9)
    with pytest.warns(UserWarning, match="base is not recorded"):
        ckpt.restore(str(tmp_path / "p"), model=fresh)
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in fresh.named_parameters())
    ckpt.save(str(tmp_path / "c"), step=1, model=model, optimizer=opt, adapter_only=True)
    r = CliRunner().invoke(
        cli, ["convert", str(tmp_path / "c"), str(tmp_path / "x"), "--to", "cuda", "--format", "ckpt"]
    )
    assert r.exit_code == 2 and "already an adapter checkpoint" in r.output and not (tmp_path / "x").exists()
    tag = tmp_path / "tag"
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "c"), str(tag), "--to", "neuron", "--format", "nxd",
                                 "--tp", "2", "--config", cfg])  # fmt: skip
    assert r.exit_code == 0, r.output
    f = tag / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    o = load_torch_file(f)
    torch.save({**o, "base_state": {}, "shape_info": {}}, f)  # the keys of NxD's ZeRO-1 optimizer file
    r = CliRunner().invoke(cli, ["convert", str(tag), str(tmp_path / "x"), "--to", "cuda", "--format", "ckpt",
                                 "--config", cfg, "--step", "1"])  # fmt: skip
    assert r.exit_code == 2 and "ZeRO-1" in r.output and not (tmp_path / "x").exists()
