"""The node-local tier with NxD state: 4 gloo ranks as 2 nodes (TP 2 within a node, DP 2 across), holding the shards
of a real NxD training tag (TP2 x DP2, ZeRO-1; ``fixtures/nxd/llama_gqa_h64``), saved by the Neuron checkpointer to
the local tier with a replica on the other node; node 1 replaced (empty ``local_dir``), then every rank restores its
own TP shard and ZeRO-1 rows, node 1's from node 0's replicas (issue 26, item 5)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_ranks
from test_neuron_multirank import FIX, TAG, TP, FakeZero1, Holder, _rank_files

from ckpt.layouts import bit_equal
from ckpt.safe_unpickle import load_torch_file

pytestmark = pytest.mark.timeout(300)


def tiers_job(rank: int, world: int, tmp: str) -> str:
    import torch.distributed as dist

    from ckpt.neuron import NeuronCheckpointManager

    tp, dp = rank % TP, rank // TP
    root = Path(tmp)
    kw: dict[str, Any] = dict(
        local_dir=str(root / f"node{dp}"), local_every=1, persist_every=100, replicas=1, node_rank=dp,
        rule_set=None, tp_rank=tp, tp_size=TP, dp_rank=dp, dp_size=world // TP,
        config=json.loads((FIX / "config.json").read_text()),
    )  # fmt: skip
    tensors, zsd = _rank_files(tp, dp)
    model = Holder(tensors)
    with NeuronCheckpointManager(str(root / "persistent"), async_save=True, **kw) as mgr:
        mgr.save(
            3,
            model=model,
            optimizer=FakeZero1(model, zsd, dp, world // TP),
            scheduler=load_torch_file(TAG / "scheduler.pt"),
        )
    dist.barrier()
    if rank == TP:
        shutil.rmtree(root / "node1")  # node 1 replaced
    dist.barrier()
    fresh = Holder(tensors, zero=True)
    opt = FakeZero1(fresh, None, dp, world // TP)
    sched: dict[str, Any] = {}
    with NeuronCheckpointManager(str(root / "persistent"), **kw) as mgr:
        step = mgr.restore_latest(model=fresh, optimizer=opt, scheduler=sched)
        tier = mgr.last_restore.tier
    assert opt.loaded is not None
    path = str(root / f"restored_{rank}.pt")
    torch.save(
        {
            "step": step,
            "tier": tier,
            "model": {n: p.detach().clone() for n, p in fresh.named_parameters()},
            "base_state": opt.loaded["base_state"],
            "sched": sched,
        },
        path,
    )
    return path


def test_nxd_tp_zero1_state_restores_from_a_peer_node(tmp_path: Path) -> None:
    out = [torch.load(p, weights_only=True) for p in run_ranks(tiers_job, 4, str(tmp_path))]
    assert [r["step"] for r in out] == [3] * 4
    assert [r["tier"] for r in out] == ["local", "local", "peer", "peer"]
    for rank, res in enumerate(out):
        tensors, zsd = _rank_files(rank % TP, rank // TP)
        assert all(bit_equal(res["model"][n], t) for n, t in tensors.items())
        assert sorted(res["base_state"]) == sorted(zsd["base_state"])
        for pid, per in zsd["base_state"].items():
            assert all(bit_equal(res["base_state"][pid][k], v) for k, v in per.items())
        assert res["sched"] == load_torch_file(TAG / "scheduler.pt")
