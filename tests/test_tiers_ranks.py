"""The node-local tier on real gloo ranks: 4 ranks as 2 nodes, each node with its own ``local_dir``, FSDP2-sharded
state (every rank holds different bytes), replicas on the other node (issue 26, item 6).

One spawned job trains and saves (local every 2 steps, persistent every 4), one is killed (SIGKILL) in the middle of
replicating a local save; then one job restores from copies of those folders, damaged in different ways, and
continues training: the state must be the saved one bit for bit and the losses those the first job logged.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import _child, free_port, run_ranks
from test_core_multirank import make, shard

import ckpt

pytestmark = pytest.mark.timeout(300)

WORLD = 4
SAVED = 6  # the newest local step; 4 is persistent (and local), 2 local only
LAST = 9  # the first job trains on to here without saving: the losses a restored job must repeat


def local_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[bytes]:
    """This rank's shards of every model and optimizer tensor, as bytes."""
    from torch.distributed.tensor import DTensor

    def raw(t: torch.Tensor) -> bytes:
        t = t._local_tensor if isinstance(t, DTensor) else t
        return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()

    out = [raw(t) for t in model.state_dict().values()]
    for p in model.parameters():
        out += [raw(v) for _, v in sorted(opt.state[p].items())]
    return out


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)
    loss = model(torch.randn(4, 6, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def fresh(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = shard(make(seed), world)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def run_dir(node_dir: Path) -> Path:
    """The run's folder in a node's ``local_dir`` (``run-<id>``)."""
    (name,) = [n for n in os.listdir(node_dir) if n.startswith("run-")]
    return node_dir / name


def manager(tmp: Path, dirs: str, node: int, **kw: Any) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(
        str(tmp / dirs / "persistent"),
        local_dir=str(tmp / dirs / f"node{node}"),
        local_every=2,
        persist_every=4,
        replicas=1,
        **kw,
    )


# ------------------------------------------------------------------------------------------------ rank jobs


def train_job(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    # node identity from torchrun's environment
    os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
    model, opt = fresh(world, seed=0)
    mgr = manager(Path(tmp), "run", rank // 2, async_save=True)
    losses, snaps = {}, {}
    for step in range(1, LAST + 1):
        losses[step] = train_step(model, opt, rank, step)
        if step <= SAVED:
            mgr.save(step, model=model, optimizer=opt)
            if step % 2 == 0:
                mgr.wait()
                snaps[step] = local_bytes(model, opt)
    mgr.close()
    return {"losses": losses, "snaps": snaps}


def killed_job(rank: int, world: int, tmp: str) -> None:
    """Saves step 2, then rank 3 is SIGKILLed right after its replicas of step 4 were exchanged."""
    import ckpt.tiers.replicate as rep

    torch.set_num_threads(1)
    real = rep.transfer

    def exchange_then_die(*a: Any, **k: Any) -> Any:
        out = real(*a, **k)
        if rank == 3 and exchange_then_die.calls == 1:  # type: ignore[attr-defined]
            os.kill(os.getpid(), signal.SIGKILL)
        exchange_then_die.calls += 1  # type: ignore[attr-defined]
        return out

    exchange_then_die.calls = 0  # type: ignore[attr-defined]
    rep.transfer = exchange_then_die
    model, opt = fresh(world, seed=0)
    mgr = manager(Path(tmp), "killed", rank // 2, node_rank=rank // 2, async_save=True)
    for step in (1, 2, 3, 4):
        train_step(model, opt, rank, step)
        mgr.save(step, model=model, optimizer=opt)
    mgr.wait()  # ranks 0-2 fail here (their peer died) or are killed by the test


def restore_job(rank: int, world: int, tmp: str, cases: list[str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    import warnings

    out = {}
    for case in cases:
        model, opt = fresh(world, seed=123)
        mgr = manager(Path(tmp), case, rank // 2, node_rank=rank // 2, async_save=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = mgr.restore_latest(model=model, optimizer=opt)
        assert mgr.last_restore is not None
        res: dict[str, Any] = {
            "step": step,
            "tier": mgr.last_restore.tier,
            "state": local_bytes(model, opt),
            "warnings": [str(w.message) for w in caught],
        }
        res["losses"] = {s: train_step(model, opt, rank, s) for s in range(step + 1, LAST + 1)}
        mgr.close()
        out[case] = res
    out["in-transit"] = corrupt_in_transit(rank, world, Path(tmp))
    return out


def corrupt_in_transit(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """A replica damaged on the wire (one byte of what rank 2 receives flipped): the local save is refused on
    every rank, nothing of it looks committed, and the previous step stays the newest."""
    from ckpt.tiers.landing import Landing

    real = Landing.publish

    def flip(self: Landing, sent: str | None) -> str | None:
        if rank == 2 and self.size:  # one bit of what arrived, after the receive, before the check
            self.tensor[self.size // 2] ^= 1
        return real(self, sent)

    model, opt = fresh(world, seed=5)
    mgr = manager(tmp, "in-transit", rank // 2, node_rank=rank // 2, async_save=False)
    assert mgr.restore_latest(model=model, optimizer=opt) == SAVED
    train_step(model, opt, rank, SAVED + 1)
    Landing.publish = flip  # type: ignore[method-assign]
    try:
        mgr.save(SAVED + 2, model=model, optimizer=opt)
        error = None
    except ckpt.CkptError as e:
        error = str(e)
    finally:
        Landing.publish = real  # type: ignore[method-assign]
    mgr.close()
    folder = run_dir(tmp / "in-transit" / f"node{rank // 2}")
    return {"error": error, "steps": sorted(n for n in os.listdir(folder) if n.startswith("step_"))}


# ------------------------------------------------------------------------------------------------ fixtures


def run_killed(tmp: Path) -> list[int | None]:
    """``killed_job`` on 4 spawned ranks: wait for rank 3's SIGKILL, give the others a moment, kill them too."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(killed_job, r, WORLD, port, (str(tmp),), results), daemon=True)
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    procs[3].join(timeout=180)
    for p in procs[:3]:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tiers")
    trained = run_ranks(train_job, WORLD, str(tmp))
    codes = run_killed(tmp)
    base = tmp / "run"

    def variant(name: str) -> Path:
        shutil.copytree(base, tmp / name)
        return tmp / name

    shutil.rmtree(variant("replaced-node") / "node1")  # a replaced node: empty local_dir
    wiped = variant("both-wiped")
    shutil.rmtree(wiped / "node0")
    shutil.rmtree(wiped / "node1")
    # rank 2's data file of step 6: its replica on node 0 damaged, then both copies
    for name, nodes in (("bad-replica", ["node0"]), ("both-copies-bad", ["node0", "node1"])):
        v = variant(name)
        for node in nodes:
            folder = run_dir(v / node) / "step_00000006"
            f = next(
                folder / n
                for n in sorted(os.listdir(folder))
                if n.startswith("r00002") and n.endswith(".safetensors")
            )
            data = bytearray(f.read_bytes())
            data[-5] ^= 0x40  # inside the last chunk's bytes
            f.write_bytes(bytes(data))
    variant("in-transit")
    cases = ["replaced-node", "both-wiped", "bad-replica", "both-copies-bad", "killed"]
    listing = {n: sorted(os.listdir(run_dir(tmp / "killed" / n))) for n in ("node0", "node1")}
    restored = run_ranks(restore_job, WORLD, str(tmp), cases)
    return {"trained": trained, "restored": restored, "kill_codes": codes, "killed_listing": listing}


def check(runs: dict[str, Any], case: str, step: int, tiers: list[str]) -> list[dict[str, Any]]:
    got = [r[case] for r in runs["restored"]]
    assert [g["step"] for g in got] == [step] * WORLD
    assert [g["tier"] for g in got] == tiers
    for rank, (g, t) in enumerate(zip(got, runs["trained"], strict=True)):
        assert g["state"] == t["snaps"][step], f"rank {rank}: restored state differs from step {step}'s"
        assert g["losses"] == {s: t["losses"][s] for s in range(step + 1, LAST + 1)}, f"rank {rank}: losses"
    return got


def test_every_rank_holds_different_bytes(runs: dict[str, Any]) -> None:
    snaps = [t["snaps"][SAVED] for t in runs["trained"]]
    assert len({b"".join(s) for s in snaps}) == WORLD


def test_a_replaced_node_gets_its_shards_from_its_peers(runs: dict[str, Any]) -> None:
    check(runs, "replaced-node", SAVED, ["local", "local", "peer", "peer"])


def test_both_nodes_wiped_restore_the_newest_persistent_step(runs: dict[str, Any]) -> None:
    check(runs, "both-wiped", 4, ["persistent"] * WORLD)


def test_a_corrupted_replica_is_detected_and_the_other_copy_used(runs: dict[str, Any]) -> None:
    got = check(runs, "bad-replica", SAVED, ["local"] * WORLD)
    assert not any(g["warnings"] for g in got)


def test_both_copies_corrupted_falls_back_to_an_older_step_on_every_rank(runs: dict[str, Any]) -> None:
    got = check(runs, "both-copies-bad", 4, ["local"] * WORLD)
    assert any(
        "local step 6: no node holds an intact r00002" in w and "checksum mismatch" in w
        for w in got[0]["warnings"]
    )


def test_a_kill_during_replication_leaves_no_committed_looking_step(runs: dict[str, Any]) -> None:
    assert runs["kill_codes"][3] == -signal.SIGKILL
    for node, names in runs["killed_listing"].items():
        assert [n for n in names if n.startswith("step_")] == ["step_00000002"], node
    check(runs, "killed", 2, ["local"] * WORLD)


def test_a_replica_damaged_in_transit_is_refused_and_nothing_commits(runs: dict[str, Any]) -> None:
    got = [r["in-transit"] for r in runs["restored"]]
    for g in got:
        assert g["error"] is not None and "local save of step 8 not committed" in g["error"]
        assert "checksum" in g["error"] or "damaged" in g["error"]
        assert g["steps"] == ["step_00000004", "step_00000006"]
