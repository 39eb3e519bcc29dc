"""Rank bodies for tests/test_nxd_real.py: a tiny Llama built from NxD 2.29's own parallel layers, trained with NxD's
own ``NeuronZero1Optimizer`` on the XLA CPU device, one gloo process per rank.

Nothing here sets a TP attribute: ``ParallelEmbedding``, ``GQAQKVColumnParallelLinear``, ``ColumnParallelLinear``
and ``RowParallelLinear`` do (and ``move_model_to_device``, NxD's, keeps them on the way to the XLA device).  NxD runs
unmodified from the vendored archive (``tests/vendor/``) with the stand-ins of ``tests/nxd_shim/`` (README there).
The decoder arithmetic between the layers (RMSNorm, causal attention without rotary embeddings, SwiGLU) is written
here: NxD's training Llama (``examples/training/llama/modeling_llama_nxd.py``) subclasses transformers 4.x internals
that transformers 5 no longer has.  Pipeline parallelism is by stage: PP rank ``s`` holds layers ``[s*L/pp,
(s+1)*L/pp)`` (the embedding on the first stage; final norm and ``lm_head`` on the last), named with global layer
numbers as NxD's ``NxDPPModel`` does, activations and their gradients passed with gloo send/recv.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

SHIM = str(Path(__file__).resolve().parent / "nxd_shim")
H, HEADS, KV, LAYERS, VOCAB, INTER, SEQ, BATCH = 32, 4, 2, 2, 64, 48, 8, 2
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "num_attention_heads": HEADS,
    "num_key_value_heads": KV, "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "intermediate_size": INTER,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float32",
    "hidden_act": "silu",
}  # fmt: skip
LR = 1e-2


# XLA CPU compiles every graph with LLVM; the tests compare runs with each other, never with another backend, so the
# cheapest optimisation level is enough (it keeps each process's arithmetic deterministic).
XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def nxd_env(nxd_src: str, tp: int, pp: int, platform: str = "trn1") -> Any:
    """In a rank process with a gloo group: NxD importable, torch_xla's collectives on gloo, NxD's parallel state.
    (torch_xla's persistent compilation cache would not help: the PJRT CPU client cannot deserialize executables.)"""
    first = "NXD_SRC" not in os.environ
    os.environ.update(NXD_CPU_MODE="1", NXD_SRC=nxd_src, NXD_SHIM_PLATFORM=platform, PJRT_DEVICE="CPU")
    for p in (nxd_src, SHIM):
        if p not in sys.path:
            sys.path.insert(0, p)
    if first:
        os.environ["XLA_FLAGS"] = XLA_FLAGS
    import xla_gloo

    xla_gloo.install()
    from neuronx_distributed.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return parallel_state


def config(kv: int = KV) -> dict[str, Any]:
    """The model's ``config.json`` with ``kv`` KV heads."""
    return dict(CONFIG, num_key_value_heads=kv)


def full_weights(kv: int = KV) -> dict[str, torch.Tensor]:
    """The logical (HF-named) initial weights, the same on every rank: each NxD layer's init_method copies its master."""
    g = torch.Generator().manual_seed(0)
    hd = H // HEADS

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    w = {
        "model.embed_tokens.weight": rnd(VOCAB, H),
        "model.norm.weight": 1 + rnd(H),
        "lm_head.weight": rnd(VOCAB, H),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": 1 + rnd(H), p + "post_attention_layernorm.weight": 1 + rnd(H),
            p + "self_attn.q_proj.weight": rnd(HEADS * hd, H), p + "self_attn.k_proj.weight": rnd(kv * hd, H),
            p + "self_attn.v_proj.weight": rnd(kv * hd, H), p + "self_attn.o_proj.weight": rnd(H, HEADS * hd),
            p + "mlp.gate_proj.weight": rnd(INTER, H), p + "mlp.up_proj.weight": rnd(INTER, H),
            p + "mlp.down_proj.weight": rnd(H, INTER),
        }  # fmt: skip
    return w


def _copy(src: torch.Tensor) -> Any:
    def init(master: torch.Tensor) -> None:
        with torch.no_grad():
            master.copy_(src)

    return init


def _norm(w: torch.Tensor) -> torch.nn.Module:
    """An RMSNorm's parameter holder (NxD's Llama keeps norms as plain modules, replicated on every TP rank)."""
    m = torch.nn.Module()
    m.register_parameter("weight", torch.nn.Parameter(w.clone()))
    return m


def stage_layers(pp_rank: int, pp: int) -> range:
    per = LAYERS // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def build(ps: Any, kv: int = KV, kv_size_multiplier: int = 1) -> torch.nn.Module:
    """This rank's stage of the model, on the XLA device, every parallel parameter cut by NxD's layers."""
    import torch_xla
    from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
    from neuronx_distributed.parallel_layers import layers
    from neuronx_distributed.utils.model_utils import move_model_to_device

    full = full_weights(kv)
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_size()
    hd = H // HEADS
    root, model = torch.nn.Module(), torch.nn.Module()
    root.add_module("model", model)
    if pp_rank == 0:
        model.add_module(
            "embed_tokens",
            layers.ParallelEmbedding(VOCAB, H, init_method=_copy(full["model.embed_tokens.weight"])),
        )
    blocks = torch.nn.ModuleDict()
    model.add_module("layers", blocks)
    for i in stage_layers(pp_rank, pp):
        p = f"model.layers.{i}."
        layer, attn, mlp = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
        blocks[str(i)] = layer
        for norm in ("input_layernorm", "post_attention_layernorm"):
            layer.add_module(norm, _norm(full[p + norm + ".weight"]))
        layer.add_module("self_attn", attn)
        qkv = iter(
            [full[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
        )  # NxD initialises q, k, v in this order
        attn.add_module(
            "qkv_proj",
            GQAQKVColumnParallelLinear(
                H, [HEADS * hd, kv * hd], bias=False, gather_output=False, kv_size_multiplier=kv_size_multiplier,
                fuse_qkv=False, init_method=lambda w, it=qkv: _copy(next(it))(w),
            ),
        )  # fmt: skip
        attn.add_module(
            "o_proj",
            layers.RowParallelLinear(
                HEADS * hd,
                H,
                bias=False,
                input_is_parallel=True,
                init_method=_copy(full[p + "self_attn.o_proj.weight"]),
            ),
        )
        layer.add_module("mlp", mlp)
        gate_up = torch.cat([full[p + "mlp.gate_proj.weight"], full[p + "mlp.up_proj.weight"]])
        mlp.add_module(
            "gate_up_proj",
            layers.ColumnParallelLinear(
                H, 2 * INTER, bias=False, gather_output=False, stride=2, init_method=_copy(gate_up)
            ),
        )
        mlp.add_module(
            "down_proj",
            layers.RowParallelLinear(
                INTER,
                H,
                bias=False,
                input_is_parallel=True,
                init_method=_copy(full[p + "mlp.down_proj.weight"]),
            ),
        )
    if pp_rank == pp - 1:
        model.add_module("norm", _norm(full["model.norm.weight"]))
        root.add_module(
            "lm_head",
            layers.ColumnParallelLinear(
                H, VOCAB, bias=False, gather_output=False, init_method=_copy(full["lm_head.weight"])
            ),
        )
    move_model_to_device(root, torch_xla.device())
    return root


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def _layer(layer: torch.nn.Module, x: torch.Tensor, tp: int, kv: int, mult: int) -> torch.Tensor:
    hd = H // HEADS
    q, k, v = layer.self_attn.qkv_proj(_rms(x, layer.input_layernorm.weight))
    b, s, _ = q.shape
    nq, nkv = HEADS // tp, kv * mult // tp
    q = q.view(b, s, nq, hd).transpose(1, 2)
    k = k.view(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nq // nkv, dim=1)
    v = v.view(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nq // nkv, dim=1)
    att = (q @ k.transpose(-1, -2)) / hd**0.5
    mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    att = att.masked_fill(~mask, float("-inf")).softmax(-1)
    x = x + layer.self_attn.o_proj((att @ v).transpose(1, 2).reshape(b, s, nq * hd))
    g, u = layer.mlp.gate_up_proj(_rms(x, layer.post_attention_layernorm.weight)).chunk(2, dim=-1)
    return x + layer.mlp.down_proj(torch.nn.functional.silu(g) * u)


def batch(step: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def train_step(
    ps: Any, root: torch.nn.Module, opt: Any, step: int, sched: Any = None, kv: int = KV, mult: int = 1
) -> float | None:
    """One step (forward, backward through the PP stages, NxD's ZeRO-1 step); the loss on the last stage."""
    import torch.distributed as dist
    import torch_xla
    from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy

    dev = torch_xla.device()
    tp = ps.get_tensor_model_parallel_size()
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_size()
    ids = batch(step, ps.get_data_parallel_rank()).to(dev)
    shape = (BATCH, SEQ, H)
    if pp_rank == 0:
        x_in = None
        x = root.model.embed_tokens(ids)
    else:
        host = torch.empty(shape)
        dist.recv(host, src=ps.get_pipeline_model_parallel_prev_rank())
        x_in = host.to(dev).requires_grad_()
        x = x_in
    for i in stage_layers(pp_rank, pp):
        x = _layer(root.model.layers[str(i)], x, tp, kv, mult)
    loss_value = None
    if pp_rank == pp - 1:
        logits = root.lm_head(_rms(x, root.model.norm.weight))
        loss = parallel_cross_entropy(logits[:, :-1].contiguous(), ids[:, 1:].contiguous()).mean()
        loss.backward()
        loss_value = float(loss.detach().cpu())
    else:
        dist.send(x.detach().cpu(), dst=ps.get_pipeline_model_parallel_next_rank())
        grad = torch.empty(shape)
        dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
        x.backward(grad.to(dev))
    if x_in is not None:
        dist.send(x_in.grad.detach().cpu(), dst=ps.get_pipeline_model_parallel_prev_rank())
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()
    torch_xla.sync()
    return loss_value


def make_optimizer(ps: Any, root: torch.nn.Module) -> Any:
    """NxD's NeuronZero1Optimizer over the DP group (as ``nxd.initialize_parallel_optimizer`` builds it), AdamW."""
    from neuronx_distributed.optimizer import NeuronZero1Optimizer

    return NeuronZero1Optimizer(
        list(root.parameters()), torch.optim.AdamW, lr=LR, betas=(0.9, 0.95), weight_decay=0.01, pin_layout=False,
        sharding_groups=ps.get_data_parallel_group(as_list=True),
        grad_norm_groups=ps.get_tensor_model_parallel_group(as_list=True), grad_clipping=True, max_norm=1.0,
        save_master_weights=True,
    )  # fmt: skip


def host_state(root: torch.nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """Every parameter and every ZeRO-1 shard of the optimizer state and master weights, on the host."""
    out = {f"model/{n}": p.detach().cpu() for n, p in root.named_parameters()}
    sd = opt.state_dict()
    for pid, per in sd["base_state"].items():
        for k, v in per.items():
            out[f"optim/{pid}/{k}"] = v.detach().cpu() if isinstance(v, torch.Tensor) else torch.tensor(v)
    for pid, v in sd.get("sharded_master_weights", {}).items():
        out[f"master/{pid}"] = v.detach().cpu()
    return out


def config_json(path: Path, kv: int = KV) -> None:
    path.write_text(json.dumps(config(kv)))
