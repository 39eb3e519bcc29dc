"""Real runs with a shape the truth generator lacks: epochs that move the loss, a curriculum, a StepLR.

A per-sample model (``torch.nn.Embedding(n, 1)``: each sample's prediction is its own parameter) trained by
SGD on noisy targets memorises: a sample's loss falls each time it is trained, so the loss steps down at every
epoch start and is flat inside an epoch, and a loader that restarts its epoch replays batches the model saw a
few steps ago (the loss drops a quarter, then climbs back).  The curriculum switches to a harder block of
samples (targets of 3x the spread) at a given step and logs it as ``data/phase`` and ``data/hard_fraction``;
``step_lr`` puts a real ``torch.optim.lr_scheduler.StepLR`` on the optimizer.

Each run checkpoints with :class:`ckpt.CheckpointManager` (model, optimizer, scheduler, loader, RNG), "crashes"
right after checkpoint N (no step overlaps), and a fresh set of objects restores it and trains on, logged as
TensorBoard scalars (``train/loss``, ``train/lr``, ``train/epoch``, the phase tags) and as the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt.manager import CheckpointManager
from ckpt.resume.ledger import LedgerWriter, checkpoints_dir, digest_ids, digest_rng

PER_EPOCH, BATCH = 16, 512
N_SAMPLES = PER_EPOCH * BATCH
LABEL_NOISE = 0.2
LR = 0.15 * BATCH  # each visit takes 30% off a sample's residual


@dataclass(frozen=True)
class Plan:
    resume_at: int
    steps: int = 96
    curriculum_at: int | None = None
    step_lr: tuple[int, float] | None = None
    loader_restart: bool = False
    weights_fresh: bool = False
    lr_halved: bool = False
    log_epoch: bool = True
    log_phase: bool = True
    seed: int = 0


class Loader:
    """Reshuffled batches of the active block of sample ids, with a saved position (epoch, index)."""

    def __init__(self, plan: Plan) -> None:
        self.plan, self.epoch, self.index, self.block = plan, 0, 0, 0

    def next(self) -> torch.Tensor:
        if self.index >= PER_EPOCH:
            self.epoch, self.index = self.epoch + 1, 0
        g = torch.Generator().manual_seed(self.plan.seed * 1000 + self.epoch)
        ids = torch.randperm(N_SAMPLES, generator=g)[self.index * BATCH : (self.index + 1) * BATCH]
        self.index += 1
        return ids + self.block * N_SAMPLES

    @property
    def position(self) -> float:
        """The fractional epoch after the batch just drawn (the HF Trainer's convention)."""
        return self.epoch + self.index / PER_EPOCH

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "block": self.block}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index, self.block = int(state["epoch"]), int(state["index"]), int(state["block"])


def _targets(plan: Plan) -> torch.Tensor:
    g = torch.Generator().manual_seed(50_000 + plan.seed)
    easy = torch.randn(N_SAMPLES, 1, generator=g)
    return torch.cat([easy, 3.0 * torch.randn(N_SAMPLES, 1, generator=g)])


def _build(plan: Plan) -> dict[str, Any]:
    model = torch.nn.Embedding(2 * N_SAMPLES, 1)
    torch.nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "dataloader": Loader(plan)}
    if plan.step_lr:
        state["scheduler"] = torch.optim.lr_scheduler.StepLR(opt, plan.step_lr[0], gamma=plan.step_lr[1])
    return state


def _train(
    plan: Plan, st: dict[str, Any], run: Path, ledger: LedgerWriter, tb: Any, first: int, last: int
) -> None:
    y = _targets(plan)
    model, opt, loader = st["model"], st["optimizer"], st["dataloader"]
    for step in range(first, last + 1):
        if plan.curriculum_at is not None and step >= plan.curriculum_at and loader.block == 0:
            loader.block = 1  # the harder block from here on; the epoch count goes on
        rng = digest_rng()
        ids = loader.next()
        target = y[ids] + LABEL_NOISE * torch.randn(len(ids), 1)
        loss = torch.nn.functional.mse_loss(model(ids), target)
        opt.zero_grad()
        loss.backward()
        lr = opt.param_groups[0]["lr"]
        opt.step()
        if "scheduler" in st:
            st["scheduler"].step()
        phase = {"data/phase": 1 + loader.block, "data/hard_fraction": float(loader.block)}
        epoch = loader.position if plan.log_epoch else None
        ledger.step(
            step, loss.item(), lr, samples=(loader.epoch * PER_EPOCH + loader.index) * BATCH, epoch=epoch,
            phase=phase if plan.curriculum_at and plan.log_phase else None, data_digest=digest_ids(ids), rng_digest=rng,
        )  # fmt: skip
        tb.add_scalar("train/loss", loss.item(), step)
        tb.add_scalar("train/lr", lr, step)
        if epoch is not None:
            tb.add_scalar("train/epoch", epoch, step)
        if plan.curriculum_at and plan.log_phase:
            for tag, value in phase.items():
                tb.add_scalar(tag, value, step)


def make_run(plan: Plan, run: Path) -> Path:
    """Train to ``plan.resume_at``, checkpoint, crash; restore in fresh objects (with the planted defect) and
    train to ``plan.steps``.  Returns ``run`` (``ledger.jsonl``, ``tb/``, ``checkpoints/``)."""
    from torch.utils.tensorboard import SummaryWriter

    torch.set_num_threads(1)
    n = plan.resume_at
    for session in (1, 2):
        ledger = LedgerWriter(run, world_size=1, deterministic=False)
        tb = SummaryWriter(str(run / "tb"))
        mgr = CheckpointManager(str(checkpoints_dir(run)), async_save=False, on_event=ledger.on_event)
        torch.manual_seed(plan.seed + 100 * session)
        st = _build(plan)
        if session == 1:
            _train(plan, st, run, ledger, tb, 1, n)
            mgr.save(n, **st)
            mgr.wait()
            mgr.close()
            tb.close()
            ledger.__exit__(RuntimeError, RuntimeError("killed"), None)
            continue
        fresh = _build(plan)["model"].state_dict() if plan.weights_fresh else None
        mgr.restore(n, **st)
        if fresh is not None:  # a strict=False load that matched no key: the fresh init stays
            st["model"].load_state_dict(fresh)
        if plan.loader_restart:  # the loader starts its epoch again (a sampler without a saved position)
            st["dataloader"].index = 0
        if plan.lr_halved:  # a new config overwrote the LR after the restore
            st["scheduler"].base_lrs = [b / 2 for b in st["scheduler"].base_lrs]
            for g in st["optimizer"].param_groups:
                g["lr"] /= 2
        _train(plan, st, run, ledger, tb, n + 1, plan.steps)
        mgr.close()
        tb.close()
        ledger.close()
    return run
