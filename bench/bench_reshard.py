"""Resharded load: a state saved by 2 ranks loaded by 1, 2 and 4 ranks, ckpt vs torch.distributed.checkpoint.

    .venv/bin/python bench/bench_reshard.py [--gib 0.25] [--repeat 3]

Both libraries save the same DTensor state (Shard(0) over 2 gloo ranks); then, in fresh process groups of 1, 2
and 4 ranks, each loads it into the new sharding. Loading at 2 ranks (no resharding) is the baseline each
resharded load is compared with. Times are medians on rank 0 between barriers. Writes
bench/results/reshard.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def make_state(gib: float, zero: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    state, n, i = {}, 0, 0
    while n < gib * (1 << 30):
        t = torch.zeros(2048, 4096) if zero else torch.randn(2048, 4096, generator=g)
        state[f"layers.{i}.weight"] = distribute_tensor(t, mesh, [Shard(0)])
        n += t.numel() * 4
        i += 1
    return state


def worker(rank: int, world: int, port: int, args: argparse.Namespace, phase: str, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp

    import ckpt

    if phase == "save":
        state = make_state(args.gib, zero=False)
        ckpt.save(f"{args.dir}/ckpt", step=1, model=state, rng=False)
        dcp.save(state, checkpoint_id=f"{args.dir}/dcp")
    else:
        state = make_state(args.gib, zero=True)
        res: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            for name, fn in (
                ("ckpt", lambda: ckpt.restore(f"{args.dir}/ckpt", model=state, rng=False)),
                ("dcp", lambda: dcp.load(state, checkpoint_id=f"{args.dir}/dcp")),
            ):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                res.setdefault(name, []).append(time.perf_counter() - t0)
        if rank == 0:
            q.put({k: statistics.median(v) for k, v in res.items()})
    dist.destroy_process_group()


def run(world: int, args: argparse.Namespace, phase: str) -> dict[str, float] | None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, phase, q)) for r in range(world)]
    for pr in procs:
        pr.start()
    out = q.get() if phase == "load" else None
    for pr in procs:
        pr.join()
        if pr.exitcode:
            raise SystemExit(f"{phase} at {world} ranks failed (exit {pr.exitcode})")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=0.25)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default="/tmp/ckpt-bench-reshard")
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    run(2, args, "save")
    results = {w: run(w, args, "load") for w in (1, 2, 4)}
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"state {args.gib:.2f} GiB saved by 2 ranks; load seconds (median of {args.repeat})")
    print(f"{'load ranks':>10} {'ckpt s':>9} {'DCP s':>9} {'ckpt/DCP':>9} {'ckpt vs 2-rank':>15}")
    table = []
    for w, r in results.items():
        assert r is not None
        vs2 = r["ckpt"] / results[2]["ckpt"]  # type: ignore[index]
        print(f"{w:>10} {r['ckpt']:9.3f} {r['dcp']:9.3f} {r['ckpt'] / r['dcp']:9.2f} {vs2:15.2f}")
        table.append({"ranks": w, "ckpt_s": r["ckpt"], "dcp_s": r["dcp"], "ckpt_vs_same_layout": vs2})
    here = os.path.dirname(os.path.abspath(__file__))
    os.makedirs(os.path.join(here, "results"), exist_ok=True)
    with open(os.path.join(here, "results", "reshard.json"), "w") as f:
        json.dump({"args": vars(args), "table": table}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
