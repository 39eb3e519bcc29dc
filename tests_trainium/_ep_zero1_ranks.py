"""Rank body for test_nxd_live_state.py: NxD 2.29's own ``NeuronEPZero1Optimizer`` (AdamW) on the XLA CPU device,
one gloo process per DP rank (tp 1, ep 2: dp 4 = expert-DP 2 x EP 2), torch_xla's collectives on gloo
(``tests/nxd_shim/xla_gloo.py``).  After one step each rank saves its live ``state_dict()``; then every rank runs
ckpt's reading (``zero1_ep.merge``) and writing (``zero1_ep.shard``) over all the live dicts, and loads ckpt's
dict for its DP rank into a fresh ``NeuronEPZero1Optimizer`` of the same parameters."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

EP = 2
#: non-expert parameters (sharded over the 4 DP ranks) and one stacked expert tensor per EP rank (over expert-DP 2);
#: odd sizes so that torch_xla's ZeRO-1 pads them
SHAPES = {"embed.weight": (5, 3), "norm.weight": (7,), "experts.gate_up": (1, 5, 3), "head.weight": (3, 4)}
EXPERT = frozenset({"experts.gate_up"})


def grad(name: str, ep_rank: int) -> torch.Tensor:
    """The gradient each rank sets: the same on every DP rank for a non-expert tensor, per EP rank for the experts;
    every element distinct, so a shard put in the wrong place cannot go unseen."""
    n = 1
    for s in SHAPES[name]:
        n *= s
    base = 1.0 + list(SHAPES).index(name) + (ep_rank if name in EXPERT else 0) * 0.5
    return (base + torch.arange(n, dtype=torch.float32) / 64).reshape(SHAPES[name])


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _optimizer(params: dict[str, torch.nn.Parameter]) -> Any:
    from neuronx_distributed.optimizer import NeuronEPZero1Optimizer

    return NeuronEPZero1Optimizer(
        list(params.values()), torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01, pin_layout=False,
        grad_clipping=False,
    )  # fmt: skip


def _params(dev: Any, ep_rank: int) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(7 + ep_rank)
    out = {}
    for name, shape in SHAPES.items():
        p = torch.nn.Parameter(torch.randn(shape, generator=g).to(dev))
        if name in EXPERT:
            p.expert_model_parallel = True  # what NxD's expert layers set on their stacked weights
        out[name] = p
    return out


def run(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    os.environ.update(NXD_CPU_MODE="1", PJRT_DEVICE="CPU")
    os.environ.setdefault(
        "XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )
    import torch.distributed as dist
    import xla_gloo

    xla_gloo.install()
    import torch_xla
    from neuronx_distributed.parallel_layers import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=EP)
    dev = torch_xla.device()
    dp_rank, ep_rank = ps.get_data_parallel_rank(), ps.get_expert_model_parallel_rank()
    edp_rank = ps.get_expert_data_parallel_rank()
    params = _params(dev, ep_rank)
    opt = _optimizer(params)
    for name, p in params.items():
        p.grad = grad(name, ep_rank).to(dev)
    opt.step()
    torch_xla.sync()
    live = _cpu(opt.state_dict())
    out = Path(out_dir)
    torch.save(live, out / f"dp{dp_rank}.pt")
    dist.barrier()
    dicts = [torch.load(out / f"dp{d}.pt", weights_only=True) for d in range(world)]

    from ckpt.converters.nxd.zero1_ep import merge, shard

    shapes = [(n, tuple(s)) for n, s in SHAPES.items()]
    named = merge(dicts, EP, ep_rank, shapes, EXPERT.__contains__, where=f"live ep {ep_rank}")
    files = shard(named, dict(shapes), world, EP, ep_rank, EXPERT.__contains__, where=f"live ep {ep_rank}")
    written = files[dp_rank]
    for g in written["param_groups"]:
        g.pop("param_names", None)  # ckpt records the names; NxD's groups have none
    fresh = _optimizer(_params(dev, ep_rank))
    fresh.load_state_dict({**written, "param_groups": [dict(g) for g in written["param_groups"]]})
    reloaded = _cpu(fresh.state_dict())
    return {
        "dp": dp_rank, "ep": ep_rank, "edp": edp_rank, "live": live, "named": _cpu(named), "written": written,
        "reloaded": reloaded, "params": {n: p.detach().cpu() for n, p in params.items()},
    }  # fmt: skip
