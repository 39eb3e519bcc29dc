"""Subprocess body of tests/test_neuron_xla.py: train a tiny Llama on the XLA CPU device, save/restore with
ckpt.neuron.  Run as ``python _neuron_xla_train.py MODE ROOT`` (MODE: full | first | resume); prints JSON."""

from __future__ import annotations

import json
import sys

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from transformers import LlamaConfig, LlamaForCausalLM

from ckpt.neuron import NeuronCheckpointManager

TOTAL, SPLIT = 6, 3


def build() -> tuple:
    torch.manual_seed(0)
    xm.set_rng_state(1234)
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=128, max_position_embeddings=64, attention_dropout=0.1,
    )  # fmt: skip
    dev = torch_xla.device()
    model = LlamaForCausalLM(cfg).to(dev)
    model.train()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-2, save_master_weights=True, grad_clipping=False
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched, dev


def step(model, opt, sched, dev, i: int) -> float:
    g = torch.Generator().manual_seed(100 + i)
    ids = torch.randint(0, 128, (2, 16), generator=g).to(dev)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    torch_xla.sync()
    return loss.item()


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    model, opt, sched, dev = build()
    out: dict = {"losses": []}
    mgr = NeuronCheckpointManager(root, async_save=True)
    start = 0
    if mode == "resume":
        start = mgr.restore_latest(model=model, optimizer=opt, scheduler=sched)
        out["restored"] = start
    stop = SPLIT if mode == "first" else TOTAL
    for i in range(start, stop):
        out["losses"].append(step(model, opt, sched, dev, i))
    if mode == "first":
        before = met.metric_data("TransferFromDeviceTime")
        fut = mgr.save(SPLIT, model=model, optimizer=opt, scheduler=sched)
        after = met.metric_data("TransferFromDeviceTime")
        out["transfers_in_save"] = after[0] - (before[0] if before else 0)
        out["staged_tensors"] = None
        # the training loop may continue while the write runs: mutate state, the checkpoint must not see it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        torch_xla.sync()
        res = fut.result()
        out["blocking_s"] = res.blocking_s
        mgr.close()
    out["params"] = {n: p.detach().cpu().double().sum().item() for n, p in list(model.named_parameters())[:3]}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
