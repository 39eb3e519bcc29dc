"""The node-local tier from the Neuron checkpointer: XLA tensors (torch-xla on the CPU, PJRT_DEVICE=CPU) on 2 gloo
ranks as 2 nodes, each with its own ``local_dir``; replicas travel as host bytes (issue 26, item 5)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import run_ranks

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.timeout(300)


def neuron_job(rank: int, world: int, tmp: str) -> dict[str, Any]:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from ckpt.neuron import NeuronCheckpointManager

    torch.set_num_threads(1)
    dev = torch_xla.device()
    parallel = {"tp_size": 1, "pp_size": 1, "dp_size": world, "tp_rank": 0, "pp_rank": 0, "dp_rank": rank}

    def build(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dev)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    def step(model: Any, opt: Any, i: int) -> float:
        g = torch.Generator().manual_seed(i)  # the same batch on both DP ranks: replicas stay equal
        loss = model(torch.randn(4, 8, generator=g).to(dev)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        xm.mark_step()
        return loss.item()

    def host(model: Any, opt: Any) -> list[bytes]:
        out = [t.detach().cpu().numpy().tobytes() for t in model.state_dict().values()]
        for st in opt.state_dict()["state"].values():
            out += [v.detach().cpu().numpy().tobytes() for _, v in sorted(st.items()) if v.dim() > 0]
        return out

    root, node = Path(tmp), f"node{rank}"
    kw = dict(
        local_dir=str(root / node), local_every=2, persist_every=100, replicas=1, node_rank=rank, **parallel
    )
    model, opt = build(0)
    losses = {}
    with NeuronCheckpointManager(str(root / "persistent"), async_save=True, **kw) as mgr:
        for i in range(1, 5):
            losses[i] = step(model, opt, i)
            mgr.save(i, model=model, optimizer=opt)
            if i == 2:
                mgr.wait()
                saved = host(model, opt)
                backend = mgr.last_result
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        shutil.rmtree(root / node)  # node 1 replaced: an empty local_dir
    dist.barrier()
    model2, opt2 = build(7)
    with NeuronCheckpointManager(str(root / "persistent"), async_save=True, **kw) as mgr2:
        got = mgr2.restore_latest(model=model2, optimizer=opt2)
        tier = mgr2.last_restore.tier
        manifest = mgr2.last_restore.manifest
    return {
        "step": got,
        "tier": tier,
        "exact": host(model2, opt2) == host(model, opt) if got == 4 else None,
        "backend": manifest.backend,
        "kind": manifest.layout.kind,
        "on_xla": str(next(model2.parameters()).device).startswith("xla"),
        "saved_path": backend.path if backend else None,
        "files_node1": sorted(os.listdir(run_step(root / "node1", 4))) if rank == 1 else None,
        "losses": losses,
        "saved": saved,
    }


def run_step(node_dir: Path, step: int) -> Path:
    """A step's folder in the run's folder of a node's ``local_dir`` (``run-<id>/step_<N>``)."""
    (run,) = node_dir.glob("run-*")
    return run / f"step_{step:08d}"


def test_neuron_checkpointer_with_the_local_tier_restores_a_replaced_node_from_its_peer(
    tmp_path: Path,
) -> None:
    r0, r1 = run_ranks(neuron_job, 2, str(tmp_path))
    assert (r0["step"], r1["step"]) == (4, 4)
    assert r0["backend"] == "neuron" and r0["kind"] == "nxd" and r0["on_xla"]
    assert r0["exact"] and r1["exact"]  # XLA state restored bit for bit on both ranks
    assert r0["tier"] == "local"
    # node 1's files came back from node 0's replicas
    assert r1["tier"] == "peer" and r1["files_node1"]  # its own state file at least came from node 0
    assert any(n.startswith("r00001-") for n in r1["files_node1"])
    assert r0["losses"] == r1["losses"]
