"""The host-memory tier (ckpt.tiers.memory): saves are one copy into shared-memory arenas that become the data files
in place (hard links, nothing written again), at most two snapshots per rank, a restart adopts the newest one, the
persistent copies run in the background; on real gloo ranks, a replaced node restores from its peer's memory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_ranks

import ckpt
from ckpt.errors import CkptError
from ckpt.tiers import memory

pytestmark = pytest.mark.timeout(120)


def model_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.clone() for t in model.state_dict().values()]
    for p in model.parameters():
        out += [v.clone() for _, v in sorted(opt.state[p].items())]
    return out


def run_folder(shm: Path) -> Path:
    (name,) = [n for n in os.listdir(shm) if n.startswith("run-")]
    return shm / name


def test_saves_link_the_arena_and_keep_two_snapshots(tmp_path: Path, shm_dir: Path) -> None:
    model, opt = model_opt(0)
    mgr = ckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(shm_dir), local_memory=True,
                                 persist_every=100)  # fmt: skip
    for step in range(1, 6):
        train(model, opt, step)
        mgr.save(step, model=model, optimizer=opt)
    mgr.wait()
    saved = snapshot(model, opt)
    run = run_folder(shm_dir)
    steps = sorted(p.name for p in run.iterdir() if p.name.startswith("step_"))
    assert steps == ["step_00000004", "step_00000005"]  # at most two snapshots per rank
    arenas = sorted((run / memory.ARENA).iterdir())
    assert len(arenas) == 2
    (data,) = (run / "step_00000005").glob("*.safetensors")
    # the data file is the arena itself (hard link: no second copy, no write)
    assert data.stat().st_nlink == 2 and data.stat().st_ino in {a.stat().st_ino for a in arenas}
    assert mgr.checkpointer.stager.io.get("linked", 0) > 0
    assert mgr.checkpointer.stager.io["buffered"] == 0
    mgr.close()
    assert not list((run / memory.ARENA).iterdir())  # names dropped at close; steps keep their bytes
    # a restarted trainer adopts the newest step from memory, bit-exact
    model2, opt2 = model_opt(1)
    mgr2 = ckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(shm_dir), local_memory=True,
                                  persist_every=100)  # fmt: skip
    assert mgr2.restore_latest(model=model2, optimizer=opt2) == 5
    assert mgr2.last_restore is not None and mgr2.last_restore.tier == "local"
    assert all(torch.equal(a, b) for a, b in zip(saved, snapshot(model2, opt2), strict=True))
    mgr2.close()


def test_persistent_copies_run_in_the_background(tmp_path: Path, shm_dir: Path) -> None:
    model, opt = model_opt(0)
    mgr = ckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(shm_dir), local_memory=True,
                                 persist_every=2)  # fmt: skip
    snaps = {}
    for step in range(1, 5):
        train(model, opt, step)
        mgr.save(step, model=model, optimizer=opt)
        snaps[step] = snapshot(model, opt)
    mgr.close()
    assert mgr.latest_step() == 4
    # the node is gone (memory lost): the persistent copy restores
    for p in shm_dir.iterdir():
        import shutil

        shutil.rmtree(p)
    model2, opt2 = model_opt(1)
    mgr2 = ckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(shm_dir), local_memory=True,
                                  persist_every=2)  # fmt: skip
    assert mgr2.restore_latest(model=model2, optimizer=opt2) == 4
    assert mgr2.last_restore is not None and mgr2.last_restore.tier == "persistent"
    assert all(torch.equal(a, b) for a, b in zip(snaps[4], snapshot(model2, opt2), strict=True))
    mgr2.close()


def test_reused_arena_never_leaves_a_complete_looking_step(tmp_path: Path, shm_dir: Path) -> None:
    """The step whose data file an arena is loses its manifest before the arena is overwritten."""
    model, opt = model_opt(0)
    mgr = ckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(shm_dir), local_memory=True,
                                 persist_every=100)  # fmt: skip
    for step in (1, 2):
        train(model, opt, step)
        mgr.save(step, model=model, optimizer=opt)
    mgr.wait()
    run = run_folder(shm_dir)
    assert (run / "step_00000001" / "manifest.json").is_file()
    stager = mgr.checkpointer.stager
    stager._arena_for(stager._slots[0]["size"], pinned=False)  # what the next save does before copying
    assert not (run / "step_00000001" / "manifest.json").exists()
    assert (run / "step_00000002" / "manifest.json").is_file()
    mgr.close()


def test_refusals_are_one_line(tmp_path: Path, shm_dir: Path) -> None:
    with pytest.raises(
        CkptError, match=r"local_memory=True: local_dir=.* expected a memory file system"
    ) as e:
        ckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(tmp_path / "disk"), local_memory=True)
    assert "\n" not in str(e.value)
    if memory.fs_type(tmp_path) in memory.MEMORY_FS:
        pytest.skip("tmp_path is itself in memory here")
    with pytest.raises(CkptError, match="at most 2 snapshots per rank"):
        ckpt.CheckpointManager(str(tmp_path / "r"), local_dir=str(shm_dir), local_memory=True, keep_local=3)
    with pytest.raises(CkptError, match="needs async_save=True"):
        ckpt.CheckpointManager(
            str(tmp_path / "r"), local_dir=str(shm_dir), local_memory=True, async_save=False
        )
    with pytest.raises(CkptError, match="needs local_dir="):
        ckpt.CheckpointManager(str(tmp_path / "r"), local_memory=True)
    # the room check at the first save: more than the file system holds
    with pytest.raises(CkptError, match=r"local_memory: .* GiB free, 2 snapshots .* need .* GiB more") as e:
        memory.check_room(shm_dir, 1 << 60, 0, "2 snapshots x 1 per rank of 0.5 GiB")
    assert "\n" not in str(e.value)
    memory.check_room(shm_dir, 1 << 20, 0, "tiny")  # fits


# ------------------------------------------------------------------------------------------------ gloo ranks


def job(rank: int, world: int, shm: str, root: str) -> dict[str, Any]:
    """Save steps 1-3 with a replica on the other node; node 1 is then replaced (its memory empty) and both ranks
    restore: rank 1 from its peer's memory."""
    import shutil

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)

    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        mesh = init_device_mesh("cpu", (world,))
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=mesh)
        return model

    def manager() -> ckpt.CheckpointManager:
        return ckpt.CheckpointManager(root, local_dir=f"{shm}/node{rank}", local_memory=True, replicas=1,
                                      node_rank=rank, persist_every=100)  # fmt: skip

    # FSDP2 without buffers, SGD with momentum: every tensor is sharded (a replicated buffer or Adam's step counters
    # are written by whichever rank the planner picks, and every rank reads them: from that rank's data file)
    model = make(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mgr = manager()
    for step in (1, 2, 3):
        g = torch.Generator().manual_seed(step + 10 * rank)
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        mgr.save(step, model=model, optimizer=opt)
    mgr.close()
    saved = local_state(model, opt)
    dist.barrier()
    if rank == 1:
        shutil.rmtree(f"{shm}/node1")
    dist.barrier()
    model = make(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for p in model.parameters():  # momentum buffers exist before the restore fills them
        p.grad = torch.zeros_like(p)
    opt.step()
    mgr = manager()
    step = mgr.restore_latest(model=model, optimizer=opt)
    assert mgr.last_restore is not None
    out = {"saved": saved, "step": step, "tier": mgr.last_restore.tier, "state": local_state(model, opt)}
    out["data_files"] = sorted(
        p.name[:6] for p in Path(f"{shm}/node{rank}").glob("run-*/step_00000003/*.safetensors")
    )
    mgr.close()
    return out


def local_state(model: Any, opt: Any) -> list[list[float]]:
    from torch.distributed.tensor import DTensor

    def loc(t: torch.Tensor) -> list[float]:
        return (t._local_tensor if isinstance(t, DTensor) else t).detach().flatten().tolist()

    out = [loc(t) for t in model.state_dict().values()]
    for p in model.parameters():
        out += [loc(v) for _, v in sorted(opt.state[p].items()) if v.dim()]
    return out


def test_replaced_node_restores_from_its_peers_memory(tmp_path: Path, shm_dir: Path) -> None:
    got = run_ranks(job, 2, str(shm_dir), str(tmp_path / "root"))
    assert [g["step"] for g in got] == [3, 3]
    assert [g["tier"] for g in got] == ["local", "peer"]
    assert all(g["state"] == g["saved"] for g in got)  # bit-exact on both ranks
    # node 0 kept its own data file and its replica of rank 1's; the replaced node fetched only what rank 1 reads
    assert got[0]["data_files"] == ["r00000", "r00001"]
    assert got[1]["data_files"] == ["r00001"]
