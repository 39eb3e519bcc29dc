"""Exact continuation: N steps straight == K steps, save, restore in a fresh process, N-K steps (bitwise losses).

The state that has to survive: model and AdamW moments, a warmup+decay SequentialLR, the dropout RNG and the
data loader's position (mid-epoch, with a per-epoch shuffle).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_ranks

import ckpt

pytestmark = pytest.mark.timeout(180)

N, K = 15, 7
DATASET = 24
BATCH = 4  # 6 batches per epoch: K=7 stops inside the second epoch


class Loader:
    """A shuffling loader whose position (epoch, batch index) is saved and restored."""

    def __init__(self, data: torch.Tensor, targets: torch.Tensor, batch: int, seed: int) -> None:
        self.data, self.targets, self.batch, self.seed = data, targets, batch, seed
        self.epoch, self.index = 0, 0

    def _order(self) -> torch.Tensor:
        return torch.randperm(len(self.data), generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index * self.batch >= len(self.data):
            self.epoch, self.index = self.epoch + 1, 0
        idx = self._order()[self.index * self.batch : (self.index + 1) * self.batch]
        self.index += 1
        return self.data[idx], self.targets[idx]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.index, self.seed = state["epoch"], state["index"], state["seed"]


def build(seed: int) -> tuple[Any, ...]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4)
    decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[4])
    g = torch.Generator().manual_seed(1234)  # the dataset is fixed; the model seed varies
    data = torch.randn(DATASET, 6, generator=g)
    loader = Loader(data, data.sum(1, keepdim=True).sin(), BATCH, seed=77 + seed)
    return model, opt, sched, loader


def train(model: Any, opt: Any, sched: Any, loader: Loader, steps: int) -> list[str]:
    losses = []
    model.train()
    for _ in range(steps):
        x, y = loader.next()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item().hex())
    return losses


def straight_and_first_part(rank: int, world: int, root: str) -> tuple[list[str], list[str]]:
    straight = train(*build(seed=0), steps=N)
    model, opt, sched, loader = build(seed=0)
    first = train(model, opt, sched, loader, steps=K)
    mgr = ckpt.CheckpointManager(root, async_save=True, keep_last=2)
    mgr.save(K, model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    mgr.close()
    return straight, first


def resumed_part(rank: int, world: int, root: str) -> tuple[int | None, list[str]]:
    # deliberately different seeds: everything must come from the checkpoint
    model, opt, sched, loader = build(seed=999)
    torch.manual_seed(4321)  # and a different RNG state, which the restore must replace
    mgr = ckpt.CheckpointManager(root)
    step = mgr.restore_latest(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    return step, train(model, opt, sched, loader, steps=N - K)


def test_resume_in_a_fresh_process_is_bitwise_identical(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    [(straight, first)] = run_ranks(straight_and_first_part, 1, root, process_group=False)
    [(step, second)] = run_ranks(resumed_part, 1, root, process_group=False)
    assert step == K
    assert len(straight) == N and len(set(straight)) > 1
    assert first == straight[:K]
    assert second == straight[K:], "resumed losses diverge from the uninterrupted run"


def test_without_rng_restore_the_run_diverges(tmp_path: Path) -> None:
    """The check above can fail: skipping the RNG (dropout) restore changes the losses."""
    root = str(tmp_path / "run")
    model, opt, sched, loader = build(seed=0)
    torch.manual_seed(5)
    straight = train(model, opt, sched, loader, steps=N)
    model, opt, sched, loader = build(seed=0)
    torch.manual_seed(5)
    train(model, opt, sched, loader, steps=K)
    ckpt.save(root, step=K, model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    model, opt, sched, loader = build(seed=1)
    torch.manual_seed(6)
    ckpt.restore(root, model=model, optimizer=opt, scheduler=sched, dataloader=loader, rng=False)
    assert loader.state_dict() == {"epoch": 1, "index": 1, "seed": 77}
    assert sched.last_epoch == K
    assert train(model, opt, sched, loader, steps=N - K) != straight[K:]
