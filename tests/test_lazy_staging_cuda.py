"""The CUDA path of staging and restore (run by bench/gpu_check.sh; skipped with the reason without a GPU).

* a lazy async save never synchronizes the host inside ``save()`` (``torch.cuda.set_sync_debug_mode("error")``
  turns any synchronizing call into an error), and the saved bytes are the state at ``save()`` time even though
  ``optimizer.step()`` and in-place edits follow at once (the step hook orders the stream on the copy's event);
* an eager async save (``lazy=False``) is ordered the same way without a host wait;
* a restore onto CUDA goes through the pinned uploader (batched non-blocking copies) and is bit-exact.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from ckpt import SaveOptions
from ckpt.format.reader import CheckpointReader
from ckpt.restoring.loader import Restorer, restore
from ckpt.saving.checkpointer import Checkpointer
from ckpt.state.training import optim_name

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh runs these)"
    ),
]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).cuda()
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


def step(m: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    opt.zero_grad()
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(seed)).cuda()
    m(x).pow(2).mean().backward()
    opt.step()


def digests(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    out = {n: sha(t) for n, t in m.state_dict().items()}
    names = {id(p): n for n, p in m.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[optim_name(names[id(p)], k)] = sha(v)
    return out


def saved(path: str) -> dict[str, str]:
    r = CheckpointReader(path)
    return {n: sha(r.read(n)) for n in r.names()}


def mutate(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for t in m.state_dict().values():
            t.add_(1.0)
        for s in opt.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    v.mul_(-3.0)


@pytest.mark.parametrize("lazy", [True, False])
def test_cuda_async_save_never_syncs_the_host_and_keeps_save_time_bytes(tmp_path: Path, lazy: bool) -> None:
    m, opt = make()
    step(m, opt, 0)
    want = digests(m, opt)
    ck = Checkpointer(async_save=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ck.save(
            str(tmp_path / "s"), step=1, model=m, optimizer=opt, options=SaveOptions(rng=False, lazy=lazy)
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    info = ck.last_staging
    assert info is not None and (info.lazy_bytes > 0) == lazy
    step(
        m, opt, 1
    )  # at once: the step hook (lazy) or save() itself (eager) ordered the stream after the copy
    ck.staged()
    mutate(m, opt)
    ck.close()
    assert saved(str(tmp_path / "s")) == want


def test_restore_onto_cuda_uses_pinned_batched_copies_and_is_exact(tmp_path: Path) -> None:
    m, opt = make()
    step(m, opt, 0)
    want = digests(m, opt)
    Checkpointer().save(str(tmp_path / "s"), step=1, model=m, optimizer=opt, options=SaveOptions(rng=False))
    m2, opt2 = make(seed=3)
    step(m2, opt2, 5)
    copies: list[int] = []

    class Counting(Restorer):
        def finish(self) -> None:
            copies.append(self._uploader.copies if self._uploader is not None else 0)
            super().finish()

    restore(str(tmp_path / "s"), model=m2, optimizer=opt2, rng=False, restorer=Counting)
    assert copies == [len(want)]  # every tensor went through the pinned uploader
    assert digests(m2, opt2) == want


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _full_digests(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    out = {n: sha(_full(t)) for n, t in m.state_dict().items()}
    names = {id(p): n for n, p in m.named_parameters()}
    for p in (q for g in opt.param_groups for q in g["params"]):
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[optim_name(names[id(p)], k)] = sha(_full(v))
    return out


def _fsdp2_nccl_rank(rank: int, world: int, port: int, tmp: str) -> dict[str, object]:
    """One rank of an FSDP2 job on NCCL: ckpt's own collectives run on its gloo group next to the NCCL one."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cuda", (world,))
        m, _ = make(seed=1)
        fully_shard(m, mesh=mesh)
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        step(m, opt, 0)
        want = _full_digests(m, opt)
        ck = Checkpointer(async_save=True)
        ck.save(f"{tmp}/fsdp", step=1, model=m, optimizer=opt, options=SaveOptions(rng=False))
        lazy = ck.last_staging.lazy_bytes if ck.last_staging else 0
        step(m, opt, 1 + rank)  # at once: the step hook orders the stream after the copy
        ck.staged()
        mutate(m, opt)
        ck.close()
        m2, _ = make(seed=5)
        fully_shard(m2, mesh=mesh)
        opt2 = torch.optim.Adam(m2.parameters(), lr=0.1)
        step(m2, opt2, 9)
        restore(f"{tmp}/fsdp", model=m2, optimizer=opt2, rng=False)
        return {"want": want, "lazy": lazy, "restored": _full_digests(m2, opt2)}
    finally:
        dist.destroy_process_group()


def test_fsdp2_on_nccl_lazy_save_and_restore_are_exact(tmp_path: Path) -> None:
    """FSDP2 / DTensor shards on NCCL (one rank per GPU, up to 2): the lazy save keeps the save-time bytes of every
    shard while training steps on, and a restore into a fresh FSDP2 model gives the same full tensors."""
    from conftest import free_port, run_ranks

    world = min(2, torch.cuda.device_count())
    out = run_ranks(_fsdp2_nccl_rank, world, free_port(), str(tmp_path), process_group=False)
    assert all(o["want"] == out[0]["want"] for o in out)
    assert all(o["lazy"] > 0 for o in out)  # every rank's shards were copied in the background
    assert saved(str(tmp_path / "fsdp")) == out[0]["want"]
    assert all(o["restored"] == out[0]["want"] for o in out)
