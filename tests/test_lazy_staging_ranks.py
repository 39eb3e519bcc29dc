"""Lazy staging on two gloo ranks: replicated (DDP-style) and FSDP2-sharded state, mutated right after ``save()``
returns; the committed bytes are the state at ``save()`` time (helpers shared with tests/test_lazy_staging.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import run_ranks
from test_lazy_staging import digests, make, mutate_everything, saved_digests, sha, train_step

from ckpt import SaveOptions
from ckpt.saving.checkpointer import Checkpointer
from ckpt.state.training import optim_name

pytestmark = pytest.mark.timeout(180)


def _full_digests(m: nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    out = {n: sha(full(t)) for n, t in m.state_dict().items()}
    names = {id(p): n for n, p in m.named_parameters()}
    for p in (q for g in opt.param_groups for q in g["params"]):
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[optim_name(names[id(p)], k)] = sha(full(v))
    return out


def _rank_job(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    # replicated (DDP-style) state: same seed on every rank, one writer per tensor
    m, opt = make()
    train_step(m, opt, 0)
    ck = Checkpointer(async_save=True)
    out["want"] = digests(m, opt)
    ck.save(f"{tmp}/repl", step=1, model=m, optimizer=opt, options=SaveOptions(rng=False))
    out["lazy"] = ck.last_staging.lazy_bytes if ck.last_staging else 0
    train_step(m, opt, 100 + rank)  # ranks diverge right away; the hook keeps each rank's saved bytes
    ck.staged()
    mutate_everything(m, opt)
    ck.close()
    # FSDP2 (DTensor shards): the owned storages are the local shards
    m, _ = make(seed=1)
    fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    train_step(m, opt, 0)
    out["want_fsdp"] = _full_digests(m, opt)
    ck = Checkpointer(async_save=True)
    ck.save(f"{tmp}/fsdp", step=1, model=m, optimizer=opt, options=SaveOptions(rng=False))
    out["lazy_fsdp"] = ck.last_staging.lazy_bytes if ck.last_staging else 0
    train_step(m, opt, 7)
    ck.staged()
    mutate_everything(m, opt)
    ck.close()
    return out


def test_two_gloo_ranks_lazy_save_keeps_save_time_bytes(tmp_path: Path) -> None:
    out = run_ranks(_rank_job, 2, str(tmp_path))
    assert out[0]["want"] == out[1]["want"]
    assert out[0]["lazy"] + out[1]["lazy"] > 0
    assert saved_digests(str(tmp_path / "repl")) == out[0]["want"]
    assert out[0]["lazy_fsdp"] > 0 and out[1]["lazy_fsdp"] > 0  # every rank's shards copied in the background
    assert out[0]["want_fsdp"] == out[1]["want_fsdp"]
    assert saved_digests(str(tmp_path / "fsdp")) == out[0]["want_fsdp"]
