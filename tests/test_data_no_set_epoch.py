"""A DistributedSampler restored on another DP size in a loop that never calls ``set_epoch`` (issue 37, item 8).

Without ``set_epoch`` a DistributedSampler deals the same full order every epoch.  The resumed sampler deals the
rest of the saved epoch once; the next epoch is the full order again, as in the uninterrupted run, not that rest
repeated.  Two real gloo ranks save mid-epoch and run on into the next epoch; one rank restores and does the same.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from conftest import run_ranks

import ckpt
from ckpt.data import track

N, PER_RANK, SAVE_AT, SEED = 12, 2, 2, 3  # 2 ranks: 3 steps of global batch 4 per epoch
KINDS = ("stateful", "plain")


def _loader(kind: str, rank: int, world: int, per_rank: int) -> Any:
    from torch.utils.data import DataLoader, DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(N))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    if kind == "plain":
        return track(DataLoader(data, batch_size=per_rank, sampler=sampler))
    return StatefulDataLoader(data, batch_size=per_rank, sampler=sampler)


def _two_epochs(loader: Any, it: Any) -> list[list[int]]:
    """The rest of the current epoch from ``it``, then one more epoch (no ``set_epoch``, as the user's loop)."""
    return [b.tolist() for b in it] + [b.tolist() for b in loader]


def save_job(rank: int, world: int, root: str) -> dict[str, list[list[int]]]:
    out = {}
    for kind in KINDS:
        loader = _loader(kind, rank, world, PER_RANK)
        it = iter(loader)
        for _ in range(SAVE_AT):
            next(it)
        ckpt.save(f"{root}/{kind}", step=SAVE_AT, model={"w": torch.zeros(2)}, dataloader=loader)
        out[kind] = _two_epochs(loader, it)
    return out


def _global(per_rank: list[list[list[int]]]) -> list[Counter]:
    steps = max(len(r) for r in per_rank)
    return [Counter(i for r in per_rank if s < len(r) for i in r[s]) for s in range(steps)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("noepoch"))
    return root, run_ranks(save_job, 2, root)


@pytest.mark.parametrize("kind", KINDS)
def test_next_epoch_after_a_resplit_restore_is_the_full_order_not_the_rest_again(saved, kind: str) -> None:
    root, ranks = saved
    want = _global([r[kind] for r in ranks])
    assert sum(want[-1].values()) == 2 * PER_RANK and len(want) == 1 + N // (2 * PER_RANK)
    loader = _loader(kind, 0, 1, 2 * PER_RANK)  # one rank, the same global batch
    res = ckpt.restore(f"{root}/{kind}", model={"w": torch.zeros(2)}, dataloader=loader)
    assert res.data.mode == "re-split"
    got = _global([_two_epochs(loader, iter(loader))])
    assert got == want
    # the next epoch holds every sample once; a third epoch is the same full order again
    assert sorted(i for c in got[1:] for i in c.elements()) == list(range(N))
    assert [b.tolist() for b in loader] == [b.tolist() for b in _loader(kind, 0, 1, 2 * PER_RANK)]
