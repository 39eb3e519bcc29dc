"""Resuming on another number of ranks: the data position continues exactly, RNG streams follow the rule.

Real gloo ranks: one spawned job saves on 4 ranks (and one on 2) with every supported loader at once
(StatefulDataLoader over a DistributedSampler, a plain DataLoader through ``ckpt.data.track``, and a Hugging Face
``datasets.Dataset`` under a StatefulDataLoader), then keeps iterating to record the uninterrupted run; restores on
2, 1 and 4 ranks (and through ``ckpt convert --to neuron --dp 2`` and back) must give the same global batches
(as multisets across ranks) when the global batch is unchanged, and the exact next samples when it changes.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_ranks

import ckpt
from ckpt.data import track

pytestmark = pytest.mark.timeout(300)

N = 70  # not a multiple of 4: DistributedSampler pads the epoch's list
GLOBAL_BATCH = 8
SAVE_AT = 3  # global steps consumed before the save
AFTER = 4  # global steps compared after it
KINDS = ("stateful", "plain", "hf")
SEED = 11


def _loader(kind: str, rank: int, world: int, per_rank: int) -> Any:
    from torch.utils.data import DataLoader, DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    if kind == "hf":
        import datasets

        ds: Any = datasets.Dataset.from_dict({"idx": list(range(N))}).with_format("torch")
    else:
        ds = list(range(N))
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    if kind == "plain":
        return track(DataLoader(ds, batch_size=per_rank, sampler=sampler))
    return StatefulDataLoader(ds, batch_size=per_rank, sampler=sampler)


def _ids(batch: Any) -> list[int]:
    if isinstance(batch, dict):
        batch = batch["idx"]
    return [int(x) for x in batch]


def _model() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


def save_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """Iterate SAVE_AT steps, save every loader's position, then AFTER more steps (the uninterrupted run)."""
    random.seed(5)  # identical on every rank: a shared stream
    torch.manual_seed(100 + rank)  # per rank
    np.random.seed(200 + rank)
    per_rank = GLOBAL_BATCH // world
    out: dict[str, Any] = {}
    loaders = {k: _loader(k, rank, world, per_rank) for k in KINDS}
    iters = {k: iter(v) for k, v in loaders.items()}
    for k in KINDS:
        for _ in range(SAVE_AT):
            next(iters[k])
    for k in KINDS:
        ckpt.save(
            f"{root}/{k}",
            step=SAVE_AT,
            model=_model(),
            dataloader=loaders[k],
            progress={"samples": SAVE_AT * GLOBAL_BATCH},
            rng_seed=1234,
        )
        out[k] = [_ids(next(iters[k])) for _ in range(AFTER)]
    return out


def restore_job(rank: int, world: int, root: str, per_rank: int, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in KINDS:
        loader = _loader(k, rank, world, per_rank)
        res = ckpt.restore(f"{root}/{k}", model=_model(), dataloader=loader)
        it = iter(loader)
        out[k] = {
            "batches": [_ids(next(it)) for _ in range(steps)],
            "mode": res.data.mode,
            "carried": res.rng_carried,
            "derived": res.rng_derived,
            "python": random.random(),
            "torch": float(torch.rand(())),
        }
    return out


def global_batches(per_rank: list[list[list[int]]]) -> list[Counter]:
    """Step-wise multisets of the samples all ranks consumed."""
    return [Counter(i for rank in per_rank for i in rank[s]) for s in range(len(per_rank[0]))]


@pytest.fixture(scope="module")
def saved4(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("dp4")
    return root, run_ranks(save_job, 4, str(root))


@pytest.fixture(scope="module")
def saved2(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("dp2")
    return root, run_ranks(save_job, 2, str(root))


def _reference(saved: list[dict[str, Any]], kind: str) -> list[Counter]:
    return global_batches([r[kind] for r in saved])


@pytest.mark.parametrize("world", [2, 1])
def test_4_to_fewer_ranks_same_global_batch(saved4, world: int) -> None:
    root, ref = saved4
    out = run_ranks(restore_job, world, str(root), GLOBAL_BATCH // world, AFTER)
    for k in KINDS:
        got = global_batches([r[k]["batches"] for r in out])
        assert got == _reference(ref, k), f"{k}: 4 -> {world} ranks"
        assert {r[k]["mode"] for r in out} == {"re-split"}


def test_2_to_4_ranks_same_global_batch(saved2) -> None:
    root, ref = saved2
    out = run_ranks(restore_job, 4, str(root), GLOBAL_BATCH // 4, AFTER)
    for k in KINDS:
        assert global_batches([r[k]["batches"] for r in out]) == _reference(ref, k), k
        assert [r[k]["derived"] for r in out] == [["numpy", "torch"]] * 4
        assert [r[k]["carried"] for r in out] == [["python"]] * 4
        # re-derived per rank: the four ranks' torch streams differ, the shared python stream is one
        assert len({r[k]["torch"] for r in out}) == 4 and len({r[k]["python"] for r in out}) == 1
