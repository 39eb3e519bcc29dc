"""Rank body for tests/test_lora_widen.py: NxD 2.29's own LoRA modules (``LoraModel`` over
``GQAQKVColumnParallelLinear`` / ``ColumnParallelLinear`` / ``RowParallelLinear``, from the vendored source with the
stand-ins of ``fixtures/nxd_lora/nxd_cpu_shim``, README there) on TP gloo ranks, loaded with ``strict=True`` from the
NxD LoRA tag ``ckpt convert`` wrote, with the ``LoraConfig`` NxD's own ``_load_config_from_json`` reads from the
tag's ``adapter_config.json``; then one training step with the tag's ``optim/`` state.

The decoder arithmetic between NxD's layers (embedding, RMSNorm, rotary, causal GQA attention on the rank's local
heads, SwiGLU, ``lm_head``) is written here as HF's Llama computes it (NxD's training Llama needs transformers 4);
the base weights are frozen, the cos/sin tables come from the HF model.  A PP tag's stages are loaded into one model
per TP rank (every stage's file of that rank), so each layer's NxD names and shapes are checked by ``strict=True``.
Collectives with ``kv_size_multiplier > 1`` (NxD's KV-replica gradient all-reduce calls torch_xla's ``xm.all_reduce``)
run through ``tests/nxd_shim/xla_gloo.py`` on gloo.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
SHIM = str(ROOT / "fixtures" / "nxd_lora" / "nxd_cpu_shim")


def _nxd(nxd_src: str, platform: str) -> None:
    os.environ.update(NXD_CPU_MODE="1", NXD_SRC=nxd_src, NXD_SHIM_PLATFORM=platform)
    for p in (nxd_src, SHIM):  # the shim first: its package __init__ files shadow NxD's
        if p not in sys.path:
            sys.path.insert(0, p)
    spec = importlib.util.spec_from_file_location("xla_gloo", ROOT / "tests" / "nxd_shim" / "xla_gloo.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.install()


def _module(**children: torch.nn.Module) -> torch.nn.Module:
    m = torch.nn.Module()
    for k, v in children.items():
        m.add_module(k, v)
    return m


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def rank_main(rank: int, world: int, nxd_src: str, work: str, flags: dict[str, Any]) -> str:
    """Run rank ``rank``; its results (logits, loss, logits after the step) go to a file (tensors passed through a
    multiprocessing queue race the child's exit), whose path is returned."""
    _nxd(nxd_src, flags.get("hw", "trn1"))
    from neuronx_distributed.modules.lora import LoraConfig, LoraModel
    from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
    from neuronx_distributed.parallel_layers import ColumnParallelLinear, RowParallelLinear, parallel_state

    w = Path(work)
    job = torch.load(w / "job.pt", weights_only=True)
    cfg = json.loads((w / "config.json").read_text())
    h, heads, kv, inter, layers = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                    "intermediate_size", "num_hidden_layers"))  # fmt: skip
    hd = h // heads
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    qkv_linear = bool(flags.get("qkv_linear"))

    def attn() -> torch.nn.Module:
        o = RowParallelLinear(heads * hd, h, bias=False, input_is_parallel=True)
        if qkv_linear:
            qkv = GQAQKVColumnParallelLinear(h, [heads * hd, kv * hd], bias=False, gather_output=False,
                                             kv_size_multiplier=flags.get("kv_size_multiplier", 1),
                                             fuse_qkv=bool(flags.get("fuse_qkv")))  # fmt: skip
            return _module(qkv_proj=qkv, o_proj=o)
        col = [
            ColumnParallelLinear(h, n, bias=False, gather_output=False)
            for n in (heads * hd, kv * hd, kv * hd)
        ]
        return _module(q_proj=col[0], k_proj=col[1], v_proj=col[2], o_proj=o)

    top = _module(model=_module(layers=torch.nn.ModuleList(
        _module(self_attn=attn(), mlp=_module(
            gate_up_proj=ColumnParallelLinear(h, 2 * inter, stride=2, bias=False, gather_output=False),
            down_proj=RowParallelLinear(inter, h, bias=False, input_is_parallel=True)))
        for _ in range(layers))))  # fmt: skip
    # the LoRA config exactly as NxD reads it from the tag's adapter_config.json (LoraModel.load_checkpoint's path)
    lora_cfg = LoraModel._load_config_from_json(None, LoraConfig(), str(w / "tag" / "adapter_config.json"))
    lm = LoraModel(top, lora_cfg).to("cpu")  # NxD puts new LoRA layers on the XLA device
    targets = set(lora_cfg.target_modules)
    sd: dict[str, torch.Tensor] = {}
    for k, v in torch.load(w / f"base_tp{rank}.pt", weights_only=True).items():
        mod, leaf = k.rsplit(".", 1)
        if mod.rsplit(".", 1)[-1] in targets:
            sd[f"{mod}.base_layer.{leaf}"] = v
    stages = sorted((w / "tag" / "model").glob(f"dp_rank_00_tp_rank_{rank:02d}_pp_rank_*.pt"))
    names_of: dict[str, list[str]] = {}
    for f in stages:
        lora = torch.load(f, weights_only=True)
        lora.pop("lora_config")
        names_of[f.name] = list(lora)
        sd.update(lora)
    lm.module.load_state_dict(sd, strict=True)  # every name and shape NxD's modules have, nothing else
    params = [(n, p) for n, p in lm.named_parameters() if p.requires_grad]
    opt = None
    optim_files = sorted((w / "tag" / "optim").glob(f"dp_rank_00_tp_rank_{rank:02d}_pp_rank_*.pt"))
    if optim_files:  # one optimizer over every stage's parameters: stage files' pids follow on
        merged: dict[str, Any] = {"state": {}, "param_groups": []}
        base = 0
        for f in optim_files:
            o = torch.load(f, weights_only=True)
            merged["state"] |= {base + int(pid): s for pid, s in o["state"].items()}
            for gi, g in enumerate(o["param_groups"]):
                if gi == len(merged["param_groups"]):
                    merged["param_groups"].append({**g, "params": []})
                merged["param_groups"][gi]["params"] += [base + p for p in g["params"]]
            base += sum(len(g["params"]) for g in o["param_groups"])
        assert base == len(params), (base, len(params))
        opt = torch.optim.AdamW([p for _, p in params], lr=1.0)
        opt.load_state_dict(merged)

    q_local, kv_local = job["q_heads"][rank], job["kv_heads"][rank]
    kv_of_q = torch.tensor([kv_local.index(q // (heads // kv)) for q in q_local])
    full = job["base"]
    eps = float(cfg.get("rms_norm_eps", 1e-6))

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x.float() * torch.rsqrt(var + eps)).to(x.dtype)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        cos, sin = job["cos"], job["sin"]
        mask = torch.full((t, t), float("-inf")).triu(1)
        x = F.embedding(ids, full["model.embed_tokens.weight"])
        for i, layer in enumerate(lm.module.model.layers):
            p = f"model.layers.{i}."
            y = rms(x, full[p + "input_layernorm.weight"])
            a = layer.self_attn
            q, k, v = a.qkv_proj(y) if qkv_linear else (a.q_proj(y), a.k_proj(y), a.v_proj(y))
            q, k, v = (z.view(b, t, -1, hd).transpose(1, 2) for z in (q, k, v))
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            k, v = k[:, kv_of_q], v[:, kv_of_q]
            s = (q @ k.transpose(-1, -2)) * hd**-0.5 + mask
            o = (
                (torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v)
                .transpose(1, 2)
                .reshape(b, t, -1)
            )
            x = x + a.o_proj(o)
            y = rms(x, full[p + "post_attention_layernorm.weight"])
            g, u = layer.mlp.gate_up_proj(y).chunk(2, dim=-1)
            x = x + layer.mlp.down_proj(F.silu(g) * u)
        return F.linear(rms(x, full["model.norm.weight"]), full["lm_head.weight"])

    def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

    ids = job["ids"]
    with torch.set_grad_enabled(not flags.get("fuse_qkv")):
        logits = forward(ids)
        loss = loss_of(logits, ids)
    out: dict[str, Any] = {"logits": logits.detach(), "loss": loss.item()}
    if opt is not None and not flags.get(
        "fuse_qkv"
    ):  # NxD's fused-QKV LoRA layer cannot backward (test docstring)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            out["logits_after"] = forward(ids)
        trained = dict(lm.module.state_dict())
        cfg_in_file = torch.load(stages[0], weights_only=True)["lora_config"]
        (w / "after" / "model").mkdir(parents=True, exist_ok=True)
        for f in stages:  # NxD's own rank files after the step (save_lora_config_adapter form)
            torch.save({**{n: trained[n].detach().clone() for n in names_of[f.name]}, "lora_config": cfg_in_file},
                       w / "after" / "model" / f.name)  # fmt: skip
        if len(stages) == 1:  # the optimizer after the step, as NxD's plain optim/ rank file (pids: NxD's order)
            (w / "after" / "optim").mkdir(exist_ok=True)
            torch.save(opt.state_dict(), w / "after" / "optim" / stages[0].name)
    torch.save(out, w / f"out_rank{rank}.pt")
    return str(w / f"out_rank{rank}.pt")
