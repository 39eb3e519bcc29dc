"""A tiny but real training loop that writes a ledger, crashes, and resumes (correctly or with one bug).

Shared by the resume tests.  The model is a small MLP regression with dropout, AdamW and a warmup-cosine
``LambdaLR``; a shuffled loader keeps its own position; NumPy noise augmentation and dropout make the Python,
NumPy and torch RNG streams all matter.  Checkpoints are plain ``torch.save`` files.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ckpt.resume.ledger import LedgerWriter, checkpoints_dir, digest_ids, digest_rng, optimizer_step

VARIANTS = (
    "correct",
    "scheduler_not_restored",
    "rng_not_restored",
    "optimizer_dropped",
    "data_position_lost",
    "scheduler_last_epoch",
    "older_checkpoint",
    "nondeterministic",
)


@dataclass(frozen=True)
class SimConfig:
    total: int = 120
    save_every: int = 20
    crash_at: int = 75
    warmup: int = 10
    base_lr: float = 1e-2
    batch: int = 16
    n_data: int = 256
    seed: int = 1234
    hidden: int = 32
    nonlinear: bool = True


def lr_lambda(cfg: SimConfig):
    def f(i: int) -> float:
        if i < cfg.warmup:
            return (i + 1) / cfg.warmup
        prog = (i - cfg.warmup) / max(1, cfg.total - cfg.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * prog))

    return f


def scheduler_factory(cfg: SimConfig):
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))


class Loader:
    """Shuffled mini-batches with a saved position (epoch, index) and a per-epoch seeded permutation."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.epoch = 0
        self.index = 0
        self.samples = 0

    def next_batch(self) -> torch.Tensor:
        per_epoch = self.cfg.n_data // self.cfg.batch
        if self.index >= per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        g = torch.Generator().manual_seed(self.cfg.seed * 1000 + self.epoch)
        perm = torch.randperm(self.cfg.n_data, generator=g)
        idx = perm[self.index * self.cfg.batch : (self.index + 1) * self.cfg.batch]
        self.index += 1
        self.samples += len(idx)
        return idx

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "samples": self.samples}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.index, self.samples = sd["epoch"], sd["index"], sd["samples"]


def dataset(cfg: SimConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.n_data, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    y = (torch.sin(x @ w) if cfg.nonlinear else 0.3 * x @ w) + 0.1 * torch.randn(cfg.n_data, 1, generator=g)
    return x, y


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])


def session(
    run_dir: Path,
    cfg: SimConfig,
    *,
    stop_at: int,
    restore_from: int | None = None,
    variant: str = "correct",
    crash: bool = False,
    deterministic: bool = True,
) -> None:
    """One process lifetime: seed, build, maybe restore, train to ``stop_at``; ``crash`` leaves no exit."""
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    x_all, y_all = dataset(cfg)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, cfg.hidden), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(cfg.hidden, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.base_lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    loader = Loader(cfg)
    ledger = LedgerWriter(run_dir, world_size=1, deterministic=deterministic, tokenizer_id="tok@v1")
    start = 0
    if restore_from is not None:
        path = checkpoints_dir(run_dir) / f"step-{restore_from:06d}.pt"
        ck = torch.load(path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        if variant == "scheduler_not_restored":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))  # fresh: warmup again
        elif variant == "scheduler_last_epoch":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg), last_epoch=ck["step"])
        else:
            sched.load_state_dict(ck["sched"])
        if variant == "optimizer_dropped":
            opt.state.clear()  # moments and per-parameter step lost, hyper-parameters kept
        if variant != "rng_not_restored":
            _set_rng_state(ck["rng"])
        if variant != "data_position_lost":
            loader.load_state_dict(ck["loader"])
        if variant == "nondeterministic":
            g = torch.Generator().manual_seed(99)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-5 * torch.randn(p.shape, generator=g))
        start = ck["step"]
        ledger.restore(start, path, seconds=0.01, optimizer_step=optimizer_step(opt))
    for step in range(start + 1, stop_at + 1):
        rng_d = digest_rng()
        idx = loader.next_batch()
        xb = x_all[idx] + torch.from_numpy(0.01 * np.random.randn(len(idx), 8)).float()
        if random.random() < 0.5:
            xb = xb.flip(0).flip(0)
        model.train()
        loss = torch.nn.functional.mse_loss(model(xb), y_all[idx])
        opt.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        ledger.step(
            step,
            loss,
            lr,
            grad_norm=gn,
            samples=loader.samples,
            data_digest=digest_ids(idx),
            rng_digest=rng_d,
        )
        if step % cfg.save_every == 0:
            ck = {
                "step": step,
                "model": model.state_dict(),
                "optim": opt.state_dict(),
                "sched": sched.state_dict(),
                "rng": _rng_state(),
                "loader": loader.state_dict(),
            }
            path = checkpoints_dir(run_dir) / f"step-{step:06d}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(ck, path)
            ledger.save(step, path, blocking_seconds=0.002, total_seconds=0.005)
    if crash:
        os.close(ledger._fd)  # SIGKILL: no exit event, nothing flushed beyond what was written
        ledger._fd = None
    else:
        ledger.close()


def simulate(run_dir: Path, variant: str = "correct", cfg: SimConfig | None = None) -> Path:
    """Train to ``crash_at``, crash, resume from the newest checkpoint (or an older one), train to the end."""
    cfg = cfg or SimConfig()
    older = variant == "older_checkpoint" or variant.endswith("+older")
    variant = variant.removesuffix("+older")
    det = variant != "nondeterministic"
    session(run_dir, cfg, stop_at=cfg.crash_at, crash=True, deterministic=det)
    newest = cfg.crash_at // cfg.save_every * cfg.save_every
    restore = newest - cfg.save_every if older else newest
    session(run_dir, cfg, stop_at=cfg.total, restore_from=restore, variant=variant, deterministic=det)
    return run_dir


def test_correct_resume_reproduces_pre_crash_steps_bitwise(tmp_path: Path) -> None:
    from ckpt.resume.sources import load_run

    run = load_run(simulate(tmp_path))
    dead, resumed = run.sessions
    pre = {r.step: r for r in dead.steps}
    overlap = [r for r in resumed.steps if r.step in pre]
    assert [r.step for r in overlap] == list(range(61, 76))
    assert all(r == type(r)(**{**_fields(pre[r.step]), "time": r.time}) for r in overlap)


def _fields(rec) -> dict:
    return {k: getattr(rec, k) for k in rec.__slots__}
