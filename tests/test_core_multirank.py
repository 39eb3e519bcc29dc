"""Real multi-process saves and restores on gloo: replicated (DDP) state and FSDP2-sharded state, resharded.

Two spawned jobs (4 ranks, then 2 ranks) do all the distributed work once per module; the tests below check
their outputs and do the single-process legs (1 -> 4 and 4 -> 1) in the test process itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import run_ranks

import ckpt
from ckpt.state.training import optim_name

pytestmark = pytest.mark.timeout(300)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.norm = nn.LayerNorm(10)
        self.out = nn.Linear(10, 3)  # 3 rows: on 4 ranks one rank holds an empty shard
        self.register_buffer("scale", torch.arange(5, dtype=torch.float32) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x)))) * self.scale[0]


def make(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def shard(model: Net, world: int) -> Net:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model.out, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, 6, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Full (unsharded) values of every model and optimizer tensor, keyed by name (collective for DTensors)."""
    out: dict[str, Any] = {n: full(t) for n, t in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state[p].items():
                out[optim_name(names[id(p)], key)] = full(value)
    out["$groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return out


def assert_bitwise(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        if not isinstance(w, torch.Tensor):
            assert g == w, name
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), name


def local_boxes(model: nn.Module, opt: torch.optim.Optimizer) -> set[tuple[str, tuple, tuple]]:
    """(name, offsets, lengths) of every sharded tensor this rank holds."""
    from ckpt.state.training import local_box

    out = set()
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        _, box, _ = local_box(p)
        out.add((n, box.offsets, box.lengths))
        for key, v in opt.state[p].items():
            if v.dim() > 0:
                _, box, _ = local_box(v)
                out.add((optim_name(names[id(p)], key), box.offsets, box.lengths))
    return out


# ------------------------------------------------------------------------------------------------ rank jobs


def job4(rank: int, world: int, tmp: str) -> Any:
    torch.set_num_threads(1)
    d = Path(tmp)
    # 1 -> 4: restore a checkpoint saved by a single plain process into an FSDP2 model on 4 ranks
    m = shard(make(seed=99), world)
    opt = torch.optim.AdamW(m.parameters(), lr=0.5)
    ckpt.restore(str(d / "single"), model=m, optimizer=opt, rng=False)
    snap = snapshot(m, opt)
    if rank == 0:
        torch.save(snap, d / "from1.pt")

    # FSDP2-sharded save on 4 ranks
    m = shard(make(seed=0), world)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    train(m, opt, rank, steps=2)
    ckpt.save(str(d / "fsdp4"), step=2, model=m, optimizer=opt)
    boxes = local_boxes(m, opt)
    snap = snapshot(m, opt)
    if rank == 0:
        torch.save(snap, d / "fsdp4.pt")

    # replicated (DDP) save on 4 ranks
    repl = replicated_job(rank, world, d / "repl4")
    if rank == 0:
        torch.save(repl, d / "repl4.pt")
    return sorted(boxes)


def replicated_job(rank: int, world: int, path: Path) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make(seed=0)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    train(ddp, opt, rank, steps=1)
    ckpt.save(str(path), step=1, model=model, optimizer=opt)
    return snapshot(model, opt)


def job2(rank: int, world: int, tmp: str) -> Any:
    torch.set_num_threads(1)
    d = Path(tmp)
    # 4 -> 2: FSDP2 on 2 ranks restores the 4-rank checkpoint
    m = shard(make(seed=7), world)
    opt = torch.optim.AdamW(m.parameters(), lr=0.3)
    res = ckpt.restore(str(d / "fsdp4"), model=m, optimizer=opt, rng=False)
    snap = snapshot(m, opt)
    if rank == 0:
        torch.save(snap, d / "from4.pt")
    repl = replicated_job(rank, world, d / "repl2")
    if rank == 0:
        torch.save(repl, d / "repl2.pt")
    return res.step


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("multirank")
    # the single-process checkpoint for the 1 -> 4 leg
    m = make(seed=3)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05)
    train(m, opt, rank=0, steps=3)
    ckpt.save(str(d / "single"), step=3, model=m, optimizer=opt)
    torch.save(snapshot(m, opt), d / "single.pt")
    boxes = run_ranks(job4, 4, str(d))
    torch.save(boxes, d / "boxes4.pt")
    steps = run_ranks(job2, 2, str(d))
    assert steps == [2, 2]
    return d


def load(p: Path) -> Any:
    return torch.load(p, weights_only=False)


# ------------------------------------------------------------------------------------------------ tests


def test_single_process_checkpoint_restores_into_fsdp2_on_4_ranks(runs: Path) -> None:
    assert_bitwise(load(runs / "from1.pt"), load(runs / "single.pt"))


def test_fsdp2_checkpoint_from_4_ranks_restores_on_2_ranks(runs: Path) -> None:
    assert_bitwise(load(runs / "from4.pt"), load(runs / "fsdp4.pt"))


def test_fsdp2_checkpoint_from_4_ranks_restores_in_one_plain_process(runs: Path) -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    m = make(seed=5)
    opt = torch.optim.AdamW(m.parameters(), lr=0.9)
    res = ckpt.restore(str(runs / "fsdp4"), model=m, optimizer=opt, rng=False)
    assert res.step == 2
    assert res.manifest.layout.world_size == 4 and res.manifest.layout.kind == "dtensor"
    assert_bitwise(snapshot(m, opt), load(runs / "fsdp4.pt"))
    # and the plain process continues training exactly like the reference would
    assert opt.param_groups[0]["weight_decay"] == 0.1


def test_fsdp2_each_rank_writes_only_its_own_shards(runs: Path) -> None:
    boxes = load(runs / "boxes4.pt")
    man = ckpt.open_checkpoint(str(runs / "fsdp4")).manifest
    sharded = {n for rank_boxes in boxes for n, _, _ in rank_boxes}
    assert sharded, "expected DTensor parameters"
    for name in sharded:
        entry = man.tensors[name]
        assert len(entry.shards) == 4, name  # one shard per rank, empty ones included
        for s in entry.shards:
            rank = man.files[s.file].rank
            assert (name, s.box.offsets, s.box.lengths) in set(map(tuple, boxes[rank])), (name, rank)
    assert sorted(f.rank for f in man.files.values()) == [0, 1, 2, 3]


def _check_replicated(path: Path, world: int) -> None:
    reader = ckpt.open_checkpoint(str(path))
    man = reader.manifest
    ranks = sorted(f.rank for f in man.files.values())
    assert ranks == list(range(world)), f"writes should be spread over all ranks, got files of ranks {ranks}"
    stored = 0
    for name, e in man.tensors.items():
        covered = sum(s.box.numel for s in e.shards)
        assert covered == torch.Size(e.shape).numel(), f"{name} stored {covered} elements of {e.shape}"
        stored += sum(s.nbytes for s in e.shards)
    assert stored == sum(e.nbytes for e in man.tensors.values()), "some tensor is stored twice"
    # every replicated tensor was written by exactly one rank
    for name, e in man.tensors.items():
        assert len({man.files[s.file].rank for s in e.shards}) == 1, name


@pytest.mark.parametrize("world", [4, 2])
def test_replicated_state_is_saved_once_spread_over_ranks(runs: Path, world: int) -> None:
    _check_replicated(runs / f"repl{world}", world)
    m = make(seed=11)
    opt = torch.optim.AdamW(m.parameters(), lr=0.7)
    ckpt.restore(str(runs / f"repl{world}"), model=m, optimizer=opt, rng=False)
    assert_bitwise(snapshot(m, opt), load(runs / f"repl{world}.pt"))


class RankLoader:
    def __init__(self, rank: int) -> None:
        self.state = {"rank": rank, "pos": 0}

    def state_dict(self) -> dict[str, int]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = dict(state)


def manager_job(rank: int, world: int, root: str) -> Any:
    """Async saves through the manager on every rank, then a damaged newest step: all ranks fall back together."""
    import warnings

    torch.set_num_threads(1)
    model = make(seed=0)
    loader = RankLoader(rank)
    mgr = ckpt.CheckpointManager(root, keep_last=2, async_save=True)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.inp.weight.fill_(float(step))
        loader.state["pos"] = 10 * step + rank
        mgr.save(step, model=model, dataloader=loader)
    mgr.close()
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:  # damage a data file of step 3 that rank 0 did not write
        man = ckpt.open_checkpoint(f"{root}/step_00000003").manifest
        victim = next(f for f in man.files.values() if f.rank == 1)
        p = Path(root) / "step_00000003" / victim.path
        raw = bytearray(p.read_bytes())
        raw[-1] ^= 0xFF
        p.write_bytes(bytes(raw))
    dist.barrier()
    fresh, fresh_loader = make(seed=5), RankLoader(-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = mgr.restore_latest(model=fresh, dataloader=fresh_loader)
    return step, float(fresh.inp.weight[0, 0]), fresh_loader.state, [str(w.message) for w in caught]


def test_manager_on_2_ranks_async_save_and_joint_fallback(tmp_path: Path) -> None:
    root = tmp_path / "run"
    out = run_ranks(manager_job, 2, str(root))
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]
    for rank, (step, w, loader_state, _) in enumerate(out):
        assert step == 2, f"rank {rank} restored step {step}"
        assert w == 2.0
        assert loader_state == {"rank": rank, "pos": 20 + rank}
    assert any("step 3" in m and "falling back" in m for m in out[0][3] + out[1][3])
