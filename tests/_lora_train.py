"""A LoRA training loop for ``check_continuation`` in plain torch (spawned processes must not pay for importing
transformers/PEFT): a tiny frozen base (embedding, two projections per layer, head) with trainable LoRA A/B on each
projection, LoRA dropout on, AdamW + warmup over the adapter only; saves are adapter-only."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from ckpt.resume.continuity import Continuation
from ckpt.resume.ledger import digest_ids, digest_rng


class LoraLinear(nn.Module):
    def __init__(self, n: int, r: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base_layer = nn.Linear(n, n, bias=False).requires_grad_(False)
        self.lora_A = nn.Linear(n, r, bias=False)
        self.lora_B = nn.Linear(r, n, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)
        self.dropout = nn.Dropout(0.1)
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


class TinyLoraLM(nn.Module):
    def __init__(self, vocab: int = 64, n: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, n).requires_grad_(False)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"q": LoraLinear(n), "o": LoraLinear(n)}) for _ in range(layers)
        )
        self.head = nn.Linear(n, vocab, bias=False).requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer["o"](torch.tanh(layer["q"](h)))
        return self.head(h)


def train_lora(c: Continuation) -> None:
    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)  # the base: the same weights in every process, as if loaded from a hub id
    model = TinyLoraLM()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 3))
    start = c.restore(model=model, optimizer=opt, scheduler=sched)
    for step in range(start, c.stop_at + 1):
        rng = digest_rng()
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        c.ledger.step(step, loss, lr, data_digest=digest_ids(ids), rng_digest=rng)
        c.save_if_due(
            step, model=model, optimizer=opt, scheduler=sched, adapter_only=True, base_source="tiny-lora"
        )
