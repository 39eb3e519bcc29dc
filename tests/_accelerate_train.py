"""A tiny accelerate training run at accelerate's defaults, for the accelerate tests (run in fresh processes).

``python tests/_accelerate_train.py OUT STEPS [--save-at N ...] [--resume DIR] [--hooks ROOT] [--kill-after N]``:
trains a two-layer MLP with dropout (so the RNG matters), AdamW, a StepLR scheduler, a ``GradScaler``-free CPU run,
a shuffled ``DataLoader`` prepared with ``use_stateful_dataloader=True`` (its position is in ``dl_state_dict.bin``)
and one ``register_for_checkpointing`` object; appends ``step loss.hex()`` lines to ``OUT/losses.txt``.  Saves
go to ``OUT/checkpoints/checkpoint_<i>`` (``automatic_checkpoint_naming``); with ``--hooks`` through
:class:`ckpt.integrations.accelerate.CkptStateHooks` (async) with the training step as ckpt's step.  ``--resume``
loads a folder first and continues from the step it was saved at; ``--kill-after N`` SIGKILLs the process right
after the save of step N returns (its async write may be in flight).  Also callable in-process (:func:`train`) by
``run_ranks`` for the two-process DDP case.
"""

from __future__ import annotations

import json
import os
import signal
import sys

os.environ.setdefault("USE_TORCH_XLA", "0")  # torch-xla must not take the device from accelerate

import torch  # noqa: E402


class Counter:
    """A registered custom object (``custom_checkpoint_0.pkl``)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = int(sd["n"])


def train(out: str, steps: int, save_at: list[int], resume: str | None = None, hooks: str | None = None,
          kill_after: int | None = None, start: int = 0, cpu: bool = False,
          hook_options: dict | None = None, counter_state: bool = True,
          at: int | None = None) -> list[tuple[int, str]]:  # fmt: skip
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

    os.makedirs(out, exist_ok=True)
    set_seed(0)
    acc = Accelerator(
        cpu=cpu,  # with LOCAL_RANK set, accelerate uses gloo ranks (MULTI_CPU) only when told the device is the CPU
        project_config=ProjectConfiguration(
            project_dir=out, automatic_checkpoint_naming=True, iteration=start
        ),
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    )
    model, opt, sched, ds = _objects()
    dl = torch.utils.data.DataLoader(
        ds, batch_size=4, shuffle=False, generator=torch.Generator().manual_seed(2)
    )
    counter = Counter()
    if counter_state:
        acc.register_for_checkpointing(counter)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    ck = None
    if hooks:
        from ckpt.integrations.accelerate import CkptStateHooks

        ck = CkptStateHooks(acc, hooks, **(hook_options or {}))
    step = 0
    if resume:
        acc.load_state(resume)
        step = counter.n if at is None else at
    losses = []
    while step < steps:
        for x, y in dl:
            step += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            counter.n = step
            losses.append((step, loss.item().hex()))
            if acc.is_main_process:
                with open(os.path.join(out, "losses.txt"), "a") as fh:
                    fh.write(f"{step} {losses[-1][1]}\n")
            if step in save_at:
                if ck is not None:
                    ck.step = step
                acc.save_state()
                if kill_after == step:
                    os.kill(os.getpid(), signal.SIGKILL)
            if step >= steps:
                break
    if ck is not None:
        ck.close()
    return losses


def _objects() -> tuple:
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 2, generator=g))
    return model, opt, sched, ds


def plain(out: str, steps: int, save_at: int) -> None:
    """The same run in a plain torch loop (no accelerate) with ``ckpt.CheckpointManager`` saving step
    ``save_at`` to ``OUT/ckpt`` (model, optimizer, scheduler, ``StatefulDataLoader`` position, RNG)."""
    import random

    import numpy as np
    from torchdata.stateful_dataloader import StatefulDataLoader

    import ckpt

    os.makedirs(out, exist_ok=True)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)  # what accelerate's set_seed(0) does on a CPU
    model, opt, sched, ds = _objects()
    dl = StatefulDataLoader(ds, batch_size=4, shuffle=False, generator=torch.Generator().manual_seed(2))
    mgr = ckpt.CheckpointManager(os.path.join(out, "ckpt"), async_save=False)
    step = 0
    with open(os.path.join(out, "losses.txt"), "a") as fh:
        for x, y in dl:
            step += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            fh.write(f"{step} {loss.item().hex()}\n")
            if step == save_at:
                mgr.save(step, model=model, optimizer=opt, scheduler=sched, dataloader=dl)
            if step >= steps:
                break
    mgr.close()


def sampler_run(out: str, epochs: int, seed: int = 7, resume: str | None = None) -> None:
    """A run whose order comes from accelerate's ``SeedableRandomSampler`` (``data_seed=seed``) over a
    ``TensorDataset``: each epoch the model takes one AdamW step per batch of 4 of the sampler's indices.  The
    sampler sits on a prepared loader of an ``IterableDatasetShard`` (``set_sampler``): the one case in which
    accelerate 1.16's ``save_state`` writes ``sampler.bin``.  Without ``resume``: ``epochs`` epochs, then
    ``save_state(OUT/state)``, then two more; with it: ``load_state(resume)`` (the sampler's classes allow-listed
    first, which accelerate's weights_only load needs), then two epochs.  Writes ``OUT/orders.json``: ``{"epochs":
    [[epoch, order, [loss.hex(), ...]], ...], "restored": [initial_seed, epoch] or None}``."""
    from accelerate import Accelerator
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler
    from accelerate.utils import set_seed

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # noqa: ANN204 - never iterated: only its loader's sampler is used
            return iter(range(24))

    os.makedirs(out, exist_ok=True)
    set_seed(0)
    acc = Accelerator()
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 2, generator=g))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl = torch.utils.data.DataLoader(IterableDatasetShard(Stream(), batch_size=4), batch_size=4)
    model, opt, dl = acc.prepare(model, opt, dl)
    dl.set_sampler(SeedableRandomSampler(ds, data_seed=seed if resume is None else 999))
    restored = None
    if resume:
        torch.serialization.add_safe_globals([SeedableRandomSampler, torch.utils.data.TensorDataset, torch.Generator])
        acc.load_state(resume)
        restored = [dl.get_sampler().initial_seed, dl.get_sampler().epoch]

    def epoch() -> list:
        sampler = dl.get_sampler()
        at, order, losses = sampler.epoch, list(sampler), []
        for i in range(0, len(order), 4):
            x, y = ds[order[i : i + 4]]
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item().hex())
        return [at, order, losses]

    done = []
    if resume is None:
        done = [epoch() for _ in range(epochs)]
        acc.save_state(os.path.join(out, "state"))
    done += [epoch() for _ in range(2)]
    with open(os.path.join(out, "orders.json"), "w") as fh:
        json.dump({"epochs": done, "restored": restored}, fh)


def read_losses(out: str) -> dict[int, str]:
    """``{step: loss.hex()}`` of every run appended to ``OUT/losses.txt`` (a resumed run's lines replace)."""
    got: dict[int, str] = {}
    with open(os.path.join(out, "losses.txt")) as fh:
        for line in fh:
            s, v = line.split()
            got[int(s)] = v
    return got


if __name__ == "__main__":
    doc = json.loads(sys.argv[1])
    for args in doc if isinstance(doc, list) else [doc]:  # a list: several runs in this one process
        kind = args.pop("kind", "plain" if args.pop("plain", False) else "train")
        {"plain": plain, "train": train, "sampler": sampler_run}[kind](**args)
