"""Hugging Face and DCP formats, and resuming training from converted checkpoints.

* HF export loads with the real ``AutoModelForCausalLM.from_pretrained`` and gives the original logits; HF import
  goes straight to the Neuron layout and back, bit-exact.
* DCP export loads into an FSDP2-sharded model and its optimizer (``get_state_dict``/``set_state_dict``) on 2 gloo
  ranks; DCP import of what ``dcp.save`` wrote is exact and reads ``.metadata`` through the allow-list only.
* A checkpoint converted cuda -> neuron -> cuda (and -> DCP) resumes training with exactly the losses of the
  uninterrupted run.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from ckpt.converters.convert import ConvertOptions, convert
from ckpt.converters.dcp import read_metadata
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import ckpt
from ckpt import open_checkpoint
from ckpt.errors import UnsafePickleError
from ckpt.layouts import bit_equal
from tests.conftest import run_ranks

CFG = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=3,
    vocab_size=64,
    intermediate_size=48,
    tie_word_embeddings=False,
    attn_implementation="eager",
)


def tiny(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CFG))


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, CFG["vocab_size"], (2, 12), generator=g)


def make_opt(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return opt, sched


def train(model, opt, sched, steps: range) -> list[float]:
    losses = []
    for s in steps:
        ids = batch(s)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[float], dict]:
    """A tiny Llama trained 3 steps and saved (cuda layout), and the losses of 3 more uninterrupted steps."""
    root = tmp_path_factory.mktemp("trained")
    model = tiny()
    opt, sched = make_opt(model)
    train(model, opt, sched, range(3))
    ckpt.save(str(root / "cuda"), step=3, model=model, optimizer=opt, scheduler=sched)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "weights.safetensors"))
    cont = train(model, opt, sched, range(3, 6))
    cfg = LlamaConfig(**CFG).to_dict()
    return root, cont, cfg


def test_hf_export_logits_equal(trained, tmp_path: Path) -> None:
    root, _, cfg = trained
    neuron = tmp_path / "neuron"
    convert(str(root / "cuda"), str(neuron), ConvertOptions.neuron(tp=2, pp=2, qkv_linear=True, config=cfg))
    hf = tmp_path / "hf"
    convert(str(neuron), str(hf), ConvertOptions(to="cuda", format="hf", max_shard_bytes=40_000))
    assert (
        len(list(hf.glob("model-*-of-*.safetensors"))) > 1 and (hf / "model.safetensors.index.json").is_file()
    )
    assert not list(tmp_path.glob(".hf.tmp-*"))
    loaded = AutoModelForCausalLM.from_pretrained(str(hf), attn_implementation="eager").eval()
    ref = tiny()
    ref.load_state_dict(_weights(root))
    ids = batch(99)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref.eval()(ids).logits)


def _weights(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(root / "weights.safetensors"))


def test_hf_import_to_neuron_and_back(trained, tmp_path: Path) -> None:
    root, _, cfg = trained
    hf = tmp_path / "hf"
    convert(str(root / "cuda"), str(hf), ConvertOptions(to="cuda", format="hf", config=cfg))
    neuron = tmp_path / "neuron"
    convert(
        str(hf),
        str(neuron),
        ConvertOptions.neuron(from_="cuda", tp=4, qkv_linear=True, kv_size_multiplier=2, hw="trn2"),
    )
    assert open_checkpoint(str(neuron)).manifest.extra["nxd"]["kv_size_multiplier"] == 2
    back = tmp_path / "back"
    convert(str(neuron), str(back), ConvertOptions(to="cuda"))
    r = open_checkpoint(str(back))
    w = _weights(root)
    assert set(r.names()) == set(w)
    for n, t in w.items():
        assert bit_equal(r.read(n), t), n


# ------------------------------------------------------------------------------------------------------ DCP


def test_dcp_import_of_dcp_save(trained, tmp_path: Path) -> None:
    """What torch's own dcp.save writes (model + get_state_dict optimizer) imports exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root, _, cfg = trained
    model = tiny()
    opt, sched = make_opt(model)
    train(model, opt, sched, range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
    out = tmp_path / "ours"
    convert(str(tmp_path / "dcp"), str(out), ConvertOptions(to="cuda", from_="cuda", step=2, config=cfg))
    r = open_checkpoint(str(out))
    for n, t in model.state_dict().items():
        assert bit_equal(r.read(n), t), n
    for n, p in model.named_parameters():
        st = opt.state[p]
        assert bit_equal(r.read(f"optim/{n}/exp_avg"), st["exp_avg"])
        assert bit_equal(ckpt.format.treecodec.decode(r.manifest.optimizer["state"][n]["step"]), st["step"])
    assert r.manifest.optimizer["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]


def test_dcp_metadata_allow_list_refuses_other_globals(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UnsafePickleError, match="builtins.print"):
        read_metadata(tmp_path)


def _fsdp_load(rank: int, world: int, dcp_dir: str, expect_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny(seed=100 + rank)  # different init: everything must come from the checkpoint
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, _ = make_opt(model)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    expect = open_checkpoint(expect_dir)
    for name, p in model.named_parameters():
        assert bit_equal(p.full_tensor(), expect.read(name)), name
        st = opt.state[p]
        assert bit_equal(st["exp_avg"].full_tensor(), expect.read(f"optim/{name}/exp_avg")), name
        assert bit_equal(st["exp_avg_sq"].full_tensor(), expect.read(f"optim/{name}/exp_avg_sq")), name
        assert float(st["step"]) == 3.0
    assert opt.param_groups[0]["lr"] == expect.manifest.optimizer["param_groups"][0]["lr"]


def test_dcp_export_loads_into_fsdp2(trained, tmp_path: Path) -> None:
    root, _, cfg = trained
    neuron = tmp_path / "neuron"
    convert(str(root / "cuda"), str(neuron), ConvertOptions.neuron(tp=2, qkv_linear=True, config=cfg))
    out = tmp_path / "dcp"
    convert(str(neuron), str(out), ConvertOptions(to="cuda", format="dcp"))
    run_ranks(_fsdp_load, 2, str(out), str(root / "cuda"))


# ------------------------------------------------------------------------------------------------------ resume


def test_resume_after_conversion_continues_loss(trained, tmp_path: Path) -> None:
    """cuda -> neuron (tp4, pp2, kv x2, trn2) -> cuda, restored: the next losses equal the uninterrupted run's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root, cont, cfg = trained
    neuron = tmp_path / "neuron"
    convert(
        str(root / "cuda"),
        str(neuron),
        ConvertOptions.neuron(tp=4, pp=2, qkv_linear=True, kv_size_multiplier=2, hw="trn2", config=cfg),
    )
    back = tmp_path / "back"
    convert(str(neuron), str(back), ConvertOptions(to="cuda"))
    model = tiny(seed=7)
    opt, sched = make_opt(model)
    res = ckpt.restore(str(back), model=model, optimizer=opt, scheduler=sched)
    assert res.step == 3
    assert train(model, opt, sched, range(3, 6)) == cont

    dcp_dir = tmp_path / "dcp"
    convert(str(neuron), str(dcp_dir), ConvertOptions(to="cuda", format="dcp"))
    model = tiny(seed=8)
    opt, sched = make_opt(model)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(dcp_dir))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    ckpt.restore(str(back), scheduler=sched, rng=False)  # the scheduler travels in our manifest
    assert train(model, opt, sched, range(3, 6)) == cont
