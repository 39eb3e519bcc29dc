"""A TP-local NxD LoRA model on each of 2 gloo ranks (names, shapes and parallel attributes as NxD's
``modules/lora`` layers have them), saved adapter-only through the Neuron checkpointer and restored."""

from __future__ import annotations

from typing import Any

import torch

from ckpt import SaveOptions


def _param(
    t: torch.Tensor, *, trainable: bool, dim: int | None = None, stride: int = 1
) -> torch.nn.Parameter:
    p = torch.nn.Parameter(t, requires_grad=trainable)
    if dim is not None:  # what NxD's set_tensor_model_parallel_attributes puts on a parallel layer's weight
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
    return p


def build(rank: int, seed: int = 0) -> torch.nn.Module:
    """One layer, TP 2: GQAQKV q (4 of 8 rows) + shared lora_A; o_proj RowParallel (cols split) + whole lora_B."""
    g = torch.Generator().manual_seed(seed * 100 + rank)  # TP shards differ per rank
    w = torch.Generator().manual_seed(7)  # the whole LoRA matrices are the same on every rank
    params = {
        "model.layers.0.self_attn.qkv_proj.base_layer.weight_q": _param(torch.randn(4, 8, generator=g), trainable=False, dim=0),
        "model.layers.0.self_attn.qkv_proj.lora_A.weight": _param(torch.randn(2, 8, generator=w), trainable=True),
        "model.layers.0.self_attn.qkv_proj.lora_B.weight_q": _param(torch.randn(4, 2, generator=g), trainable=True, dim=0),
        "model.layers.0.self_attn.o_proj.base_layer.weight": _param(torch.randn(8, 4, generator=g), trainable=False, dim=1),
        "model.layers.0.self_attn.o_proj.lora_A.weight": _param(torch.randn(2, 4, generator=g), trainable=True, dim=1),
        "model.layers.0.self_attn.o_proj.lora_B.weight": _param(torch.randn(8, 2, generator=w), trainable=True),
    }  # fmt: skip
    holder = torch.nn.Module()
    for name, p in params.items():
        *path, leaf = name.split(".")
        mod = holder
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, p)
    return holder


def save_and_restore(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from ckpt.errors import BaseMismatchError
    from ckpt.neuron import NeuronCheckpointer, ParallelInfo, restore

    model = build(rank)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    opt.step()
    saver = NeuronCheckpointer(tp_rank=rank, tp_size=world)
    saver.save(
        f"{tmp}/a",
        step=3,
        model=model,
        optimizer=opt,
        options=SaveOptions(adapter_only=True, base_source="nxd/base"),
    ).result()
    saver.close()
    par = ParallelInfo(tp_rank=rank, tp_size=world)
    fresh = build(rank)
    opt2 = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    restore(f"{tmp}/a", model=fresh, optimizer=opt2, parallel=par, rng=False)
    same = all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
    )
    other = build(rank, seed=1 if rank == 1 else 0)  # rank 1's base shard differs
    refused = None
    try:
        restore(f"{tmp}/a", model=other, parallel=par, rng=False)
    except BaseMismatchError as e:
        refused = str(e)
    return {"same": same, "refused": refused, "opt": torch.equal(opt.state_dict()["state"][0]["exp_avg"],
                                                                   opt2.state_dict()["state"][0]["exp_avg"])}  # fmt: skip
