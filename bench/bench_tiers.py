"""Save stall and restore time of the same state from each tier, in one run: the node-local tier, a peer's replica,
and the persistent tier on S3 (moto on 127.0.0.1) and on local disk.

    .venv/bin/python bench/bench_tiers.py [--state-mib 64] [--repeat 2]

2 gloo ranks play 2 nodes (``node_rank=``), each with its own ``local_dir``; an FSDP2-sharded MLP with Adam holds
``--state-mib`` of fp32 state over both ranks.  Per case and repeat, every rank builds a fresh manager:

* save: ``CheckpointManager.save`` of one step, async, then ``wait()``: ``stall`` is the time inside ``save`` (the
  training thread's cost), ``total`` until the step is committed (for the local tier: replicas sealed and the
  per-node commit done; nothing sent to the object store);
* restore: ``restore_latest`` into a fresh model: ``local`` (both nodes hold the step), ``peer`` (node 1's
  ``local_dir`` emptied first: its files come from node 0's replicas over gloo), ``persistent`` (no local tier);
* ``memory``: the same two with the host-memory tier (``local_dir`` in /dev/shm, ``local_memory=True``).

Times are the slowest rank's.  Ratios are against the persistent S3 tier measured in the same run.  Prints a table
and writes ``bench/results/tiers.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def build(state_mib: int, world: int) -> tuple[Any, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    width = 512
    layers = max(1, round(state_mib * 2**20 / 12 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss = model(torch.ones(2, width)).pow(2).mean()
    loss.backward()
    opt.step()  # Adam's moments exist: the whole state is saved
    return model, opt


def rank_main(rank: int, world: int, port: int, args: dict[str, Any], out: Any) -> None:
    import torch
    import torch.distributed as dist

    import ckpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tmp, s3url, s3opt = args["tmp"], args["s3url"], args["s3opt"]
    results: dict[str, list[float]] = {}

    def timed(name: str, seconds: float) -> None:
        slowest = [0.0] * world
        dist.all_gather_object(slowest, seconds)
        results.setdefault(name, []).append(max(slowest))

    for rep in range(args["repeat"]):
        base = f"{tmp}/rep{rep}"
        cases = {
            "persistent S3": dict(root=f"{s3url}/rep{rep}", storage_options=s3opt),
            "persistent disk": dict(root=f"{base}/disk"),
            "local": dict(
                root=f"{s3url}/rep{rep}-tiered", storage_options=s3opt, local_dir=f"{base}/node{rank}",
                local_every=1, persist_every=10**9, replicas=1, node_rank=rank,
            ),
            "memory": dict(
                root=f"{s3url}/rep{rep}-memory", storage_options=s3opt,
                local_dir=f"{args['shm']}/rep{rep}/node{rank}", local_memory=True,
                persist_every=10**9, replicas=1, node_rank=rank,
            ),
        }  # fmt: skip
        for name, kw in cases.items():
            model, opt = build(args["state_mib"], world)
            root = kw.pop("root")
            with ckpt.CheckpointManager(root, async_save=True, **kw) as mgr:
                dist.barrier()
                t0 = time.perf_counter()
                mgr.save(1, model=model, optimizer=opt)
                stall = time.perf_counter() - t0
                mgr.wait()
                total = time.perf_counter() - t0
            timed(f"save {name} stall", stall)
            timed(f"save {name} total", total)
            restores = {"local": ["local", "peer"], "memory": ["memory", "memory peer"]}.get(name, [name])
            for r in restores:
                if r.endswith("peer") and rank == 1:
                    shutil.rmtree(kw["local_dir"])
                dist.barrier()
                model2, opt2 = build(args["state_mib"], world)
                with ckpt.CheckpointManager(root, **kw) as mgr:
                    dist.barrier()
                    t0 = time.perf_counter()
                    step = mgr.restore_latest(model=model2, optimizer=opt2)
                    seconds = time.perf_counter() - t0
                    assert step == 1 and mgr.last_restore is not None
                    assert mgr.last_restore.tier == (
                        "persistent"
                        if r.startswith("persistent")
                        else ("peer" if r.endswith("peer") and rank == 1 else "local")
                    )
                timed(f"restore {r}", seconds)
    dist.destroy_process_group()
    if rank == 0:
        out.put(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "tiers.json"))
    a = ap.parse_args()
    import multiprocessing as mp

    from conftest import free_port
    from torture.s3 import moto_server

    shm = tempfile.mkdtemp(prefix="ckpt-bench-tiers-", dir="/dev/shm")
    with moto_server(bucket="bench") as endpoint, tempfile.TemporaryDirectory() as tmp:
        args = {
            "tmp": tmp,
            "shm": shm,
            "s3url": "s3://bench/run",
            "s3opt": {"client_kwargs": {"endpoint_url": endpoint}},
            "state_mib": a.state_mib,
            "repeat": a.repeat,
        }
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, 2, port, args, q)) for r in range(2)]
        for p in procs:
            p.start()
        results = q.get(timeout=3600)
        for p in procs:
            p.join()
    shutil.rmtree(shm, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    base_save = med["save persistent S3 stall"], med["save persistent S3 total"]
    base_restore = med["restore persistent S3"]
    rows = []
    for tier in ("memory", "local", "persistent disk", "persistent S3"):
        st, tot = med[f"save {tier} stall"], med[f"save {tier} total"]
        rows.append((f"save to {tier}", st, tot, st / base_save[0], tot / base_save[1]))
    for r in ("memory", "memory peer", "local", "peer", "persistent disk", "persistent S3"):
        s = med[f"restore {r}"]
        rows.append((f"restore from {r}", None, s, None, s / base_restore))
    print(f"state {a.state_mib} MiB over 2 ranks (2 nodes), median of {a.repeat}; ratios vs persistent S3")
    print(f"{'case':28} {'stall s':>9} {'total s':>9} {'stall x':>8} {'total x':>8}")
    for name, st, tot, rs, rt in rows:
        f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        print(f"{name:28} {f(st):>9} {f(tot):>9} {f(rs, 2):>8} {f(rt, 2):>8}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(
            {"state_mib": a.state_mib, "repeat": a.repeat, "samples": results, "median": med}, fh, indent=1
        )


if __name__ == "__main__":
    main()
