"""A tiny Lightning run with CkptCheckpointIO, as tests/test_lightning_plugin.py drives it (in process, in a
subprocess it SIGKILLs, or under DDP/FSDP on gloo ranks).  ``python tests/_lightning_run.py ROOT MAX_STEPS
[--kill-at N] [--resume PATH]`` appends ``step loss.hex()`` lines to ROOT/losses-<pid>.txt."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("USE_TORCH_XLA", "0")
os.environ.setdefault("PJRT_DEVICE", "CPU")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ckpt.integrations.lightning import CkptCheckpointIO  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.losses: list[tuple[int, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.seen += 1
        self.log("train_loss", loss)
        self.losses.append((int(self.global_step), float(loss.detach())))
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int = 16, batch: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    # not shuffled: Lightning restores no sampler RNG, so a resumed shuffled epoch would draw another order
    return DataLoader(TensorDataset(x, y), batch_size=batch)


class _Kill(pl.Callback):
    """SIGKILL this process once step ``at`` is done and its checkpoint is committed (a crash, nothing cleaned up)."""

    def __init__(self, at: int, io: CkptCheckpointIO) -> None:
        self.at, self.io = at, io

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            self.io.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def trainer(root: Path, max_steps: int, io: CkptCheckpointIO, callbacks: list[Any] = (), **kw: Any) -> pl.Trainer:
    ckpts = ModelCheckpoint(
        dirpath=root / "ckpts", every_n_train_steps=2, save_top_k=2, monitor="train_loss", save_last=True
    )
    kw.setdefault("accelerator", "cpu")
    kw.setdefault("devices", 1)
    return pl.Trainer(
        default_root_dir=root,
        max_steps=max_steps,
        plugins=[io],
        callbacks=[ckpts, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        **kw,
    )


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("max_steps", type=int)
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--resume")
    a = ap.parse_args(argv)
    pl.seed_everything(0, workers=True)
    io = CkptCheckpointIO()
    model = Tiny()
    cbs = [_Kill(a.kill_at, io)] if a.kill_at else []
    out = a.root / f"losses-{os.getpid()}.txt"

    class _Record(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            step, loss = module.losses[-1]
            with out.open("a") as fh:
                fh.write(f"{step} {loss.hex()}\n")

    trainer(a.root, a.max_steps, io, [_Record(), *cbs], deterministic=True).fit(
        model, data(), ckpt_path=a.resume
    )


if __name__ == "__main__":
    main(sys.argv[1:])
