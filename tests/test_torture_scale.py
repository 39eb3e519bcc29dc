"""Scale: 1,000 checkpoints under one root, a checkpoint of 100,000 tensors, a single tensor over 2 GiB.

No timing asserts here: bench/torture_scale.py measures (listing 1,000 checkpoints, saving/verifying/loading
100,000 tensors); these tests check that the results are right at that scale.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torture.scale import many_checkpoints, many_tensors

import ckpt
from ckpt import SaveOptions
from ckpt.format.integrity import verify_checkpoint
from ckpt.restoring.discovery import list_checkpoints

pytestmark = pytest.mark.timeout(600)


def test_one_thousand_checkpoints_list_in_step_order(tmp_path: Path) -> None:
    root = tmp_path / "run"
    many_checkpoints(str(root), 1000)
    (root / "step_00001001").mkdir()  # an interrupted save on top
    infos = list_checkpoints(str(root))
    assert [i.step for i in infos] == list(range(1, 1002))
    assert [i.status for i in infos] == ["committed"] * 1000 + ["uncommitted"]
    mgr = ckpt.CheckpointManager(str(root), async_save=False)
    assert mgr.latest_step() == 1000


@pytest.mark.slow
def test_one_hundred_thousand_tensors_save_verify_load(tmp_path: Path) -> None:
    state = many_tensors(100_000)
    path = str(tmp_path / "c")
    ckpt.save(path, step=1, model=state, rng=False)
    reader = ckpt.open_checkpoint(path)
    assert len(reader.manifest.tensors) == 100_000
    assert verify_checkpoint(reader) == []
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    ckpt.restore(path, model=back, rng=False)
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.slow
def test_a_single_tensor_over_2_gib_round_trips(tmp_path: Path) -> None:
    # uint8 keeps it cheap; one chunk (chunk_bytes above the size) so a single shard and a single ranged read
    # cross the 2**31-byte boundary (Linux caps one read() at 0x7ffff000 bytes: the reader must loop)
    n = (1 << 31) + 4097
    big = torch.empty(n, dtype=torch.uint8)
    big[: 1 << 20] = torch.arange(1 << 20, dtype=torch.int64).remainder(251).to(torch.uint8)
    big[-(1 << 20) :] = 7
    big[1 << 20 : -(1 << 20)] = 3
    path = str(tmp_path / "big")
    ckpt.Checkpointer(chunk_bytes=4 << 30).save(
        path, step=1, model={"big": big}, options=SaveOptions(rng=False)
    ).result()
    reader = ckpt.open_checkpoint(path)
    (shard,) = reader.manifest.tensors["big"].shards
    assert shard.nbytes == n
    back = torch.zeros(n, dtype=torch.uint8)
    ckpt.restore(path, model={"big": back}, rng=False)
    assert torch.equal(back, big)
    del back
    part = torch.empty(8192, dtype=torch.uint8)  # a box straddling the 2 GiB offset
    from ckpt.format.manifest import Box

    reader.read_box_into("big", Box(((1 << 31) - 4096,), (8192,)), part)
    assert torch.equal(part, big[(1 << 31) - 4096 : (1 << 31) + 4096])
