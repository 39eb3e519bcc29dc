"""The README's training loop resumes bit-exact with data loaders at their defaults (issue 29, point 7).

A DataLoader draws a seed from torch's global RNG whenever an iterator is created.  The uninterrupted run created
its iterator at the start of the epoch; the resumed one creates it right after ckpt restored the global RNG, and
that extra draw used to shift every dropout mask after a resume.  Each case runs the README loop
(``start = (mgr.restore_latest(...) or 0) + 1``, save every ``every`` steps) uninterrupted, then crashed after a save
and restarted from the newest checkpoint, and compares every loss bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import ckpt

TOTAL = 14
SAMPLES = 20  # 5 batches of 4 per epoch: the resumed runs cross epoch boundaries


def _dataset() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, generator=g) for _ in range(SAMPLES)]


def _stateful(ds: list[torch.Tensor]) -> tuple[Any, Any]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(ds, batch_size=4, shuffle=True), None  # defaults: no generator=


def _stateful_workers(ds: list[torch.Tensor]) -> tuple[Any, Any]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(ds, batch_size=4, shuffle=True, num_workers=1), None


def _stateful_generator(ds: list[torch.Tensor]) -> tuple[Any, Any]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(
        ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3)
    ), None


def _workers_generator(ds: list[torch.Tensor]) -> tuple[Any, Any]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    g = torch.Generator().manual_seed(3)
    return StatefulDataLoader(ds, batch_size=4, shuffle=True, num_workers=1, generator=g), None


def _tracked(ds: list[torch.Tensor]) -> tuple[Any, Any]:
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3)
    return ckpt.data.track(DataLoader(ds, batch_size=4, sampler=sampler)), sampler


def _batches(loader: Any, sampler: Any, epoch: int) -> Iterator[torch.Tensor]:
    """Epoch after epoch, as a training loop reads them (a DistributedSampler is told each new epoch)."""
    while True:
        yield from loader
        epoch += 1
        if sampler is not None:
            sampler.set_epoch(epoch)


def _run(root: str, build: Any, every: int, crash_after: int | None = None) -> dict[int, float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    loader, sampler = build(_dataset())
    mgr = ckpt.CheckpointManager(root, keep_last=3)
    # the README's loop
    start = (mgr.restore_latest(model=model, optimizer=opt, scheduler=sched, dataloader=loader) or 0) + 1
    epoch = mgr.last_restore.data.epoch if mgr.last_restore and mgr.last_restore.data.epoch else 0
    batches = _batches(loader, sampler, epoch)
    losses = {}
    for step in range(start, TOTAL + 1):
        loss = model(next(batches)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses[step] = loss.item()
        if step % every == 0:
            mgr.save(step, model=model, optimizer=opt, scheduler=sched, dataloader=loader)
        if step == crash_after:
            break
    mgr.close()
    return losses


@pytest.mark.parametrize("every", [3, 5], ids=["mid-epoch", "epoch-end"])
@pytest.mark.parametrize(
    "build",
    [_stateful, _stateful_workers, _stateful_generator, _workers_generator, _tracked],
    ids=["stateful", "workers", "generator", "workers-generator", "tracked"],
)
def test_readme_loop_resumes_bit_exact_with_default_loaders(tmp_path, build, every):
    reference = _run(str(tmp_path / "straight"), build, every)
    crashed = str(tmp_path / "crashed")
    first = _run(crashed, build, every, crash_after=2 * every + 1)  # one step after the second save is lost
    resumed = _run(crashed, build, every)
    assert min(resumed) == 2 * every + 1, "the restart did not resume from the newest checkpoint"
    assert first == {s: reference[s] for s in first}
    diverged = [s for s in resumed if resumed[s] != reference[s]]
    assert not diverged, f"resumed losses differ from the uninterrupted run at steps {diverged}"


def test_tracked_loader_no_adapter_can_reposition_is_refused_at_save(tmp_path):
    """track(DataLoader(shuffle=True)) keeps only a batch count: a restore would restart the epoch in a new order."""
    loader = ckpt.data.track(DataLoader(_dataset(), batch_size=4, shuffle=True))
    next(iter(loader))
    with pytest.raises(ckpt.StateMismatchError, match="StatefulDataLoader.*DistributedSampler") as e:
        ckpt.save(str(tmp_path / "step_00000001"), step=1, model=torch.nn.Linear(4, 1), dataloader=loader)
    assert "sampler RandomSampler" in str(e.value)
    assert not (tmp_path / "step_00000001" / "manifest.json").exists()
