"""Save / load benchmark: ckpt vs torch.distributed.checkpoint, torch.save and safetensors, in the same run.

    .venv/bin/python bench/bench_save_load.py [--gib 1.0] [--ranks 2] [--repeat 3] [--dir /tmp/ckpt-bench]

Each of --ranks gloo processes holds its shard of a --gib GiB state (DTensor, Shard(0), fp32 and bf16 tensors of
LLM-like sizes).  Every method saves and loads the same state; times are medians (or, with --stat best, minima: the usual
choice on a noisy shared machine) over --repeat runs, taken on
rank 0 between barriers.  Baselines: one memory copy of the local state, raw sequential write (+fsync) / read
of the same bytes.  Prints a table and writes bench/results/save_load.json.
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

import safetensors.torch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckpt import SaveOptions


def make_state(gib: float) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    total = int(gib * (1 << 30))
    state: dict[str, torch.Tensor] = {}
    n, i = 0, 0
    g = torch.Generator().manual_seed(0)
    while n < total:
        rows = 4096 if i % 3 else 1024
        dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
        t = torch.randn(rows, 4096, generator=g).to(dtype)
        state[f"layers.{i}.weight"] = distribute_tensor(t, mesh, [Shard(0)])
        n += t.numel() * t.element_size()
        i += 1
    return state


class Holder(torch.nn.Module):
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for k, v in state.items():
            self.register_buffer(k.replace(".", "_"), v)


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def worker(rank: int, world: int, port: int, args: argparse.Namespace, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp

    import ckpt

    state = make_state(args.gib)
    local = {k: v.to_local() for k, v in state.items()}
    local_bytes = sum(t.numel() * t.element_size() for t in local.values())
    res: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        res.setdefault(key, []).append(value)

    base = args.dir
    # DCP's async_save runs collectives from a background thread: like torchtitan, give it its own group so they
    # cannot interleave with the main thread's barriers (its default-group path deadlocks here).
    dcp_pg = dist.new_group(backend="gloo")
    saver_sync = ckpt.Checkpointer(async_save=False)
    saver_async = ckpt.Checkpointer(async_save=True)

    def one_repetition(d: str) -> None:
        # --- baselines
        dst = {k: torch.empty_like(v) for k, v in local.items()}
        add("memcpy", timed(lambda: [dst[k].copy_(v) for k, v in local.items()]))
        dst.clear()
        raw = f"{d}/raw-{rank}.bin"
        os.makedirs(d, exist_ok=True)

        def raw_write() -> None:
            fd = os.open(raw, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for t in local.values():
                os.write(fd, t.reshape(-1).view(torch.uint8).numpy())
            os.fsync(fd)
            os.close(fd)

        def raw_read() -> None:
            fd = os.open(raw, os.O_RDONLY)
            for t in local.values():
                os.readv(fd, [t.reshape(-1).view(torch.uint8).numpy()])
            os.close(fd)

        add("raw write", timed(raw_write))
        add("raw read", timed(raw_read))
        # --- ckpt
        add(
            "ckpt save",
            timed(
                lambda: saver_sync.save(
                    f"{d}/ckpt-sync", step=1, model=state, options=SaveOptions(rng=False)
                ).result()
            ),
        )
        fut = {}
        add(
            "ckpt async blocking",
            timed(
                lambda: fut.setdefault(
                    "f",
                    saver_async.save(f"{d}/ckpt-async", step=1, model=state, options=SaveOptions(rng=False)),
                )
            ),
        )
        t0 = time.perf_counter()
        saver_async.wait()
        dist.barrier()
        add("ckpt async total", res["ckpt async blocking"][-1] + time.perf_counter() - t0)
        add("ckpt load", timed(lambda: ckpt.restore(f"{d}/ckpt-sync", model=state, rng=False)))
        # --- torch.distributed.checkpoint
        add("dcp save", timed(lambda: dcp.save(state, checkpoint_id=f"{d}/dcp-sync")))
        holder = {}
        add(
            "dcp async_save blocking",
            timed(
                lambda: holder.setdefault(
                    "f", dcp.async_save(state, checkpoint_id=f"{d}/dcp-async", process_group=dcp_pg)
                )
            ),
        )
        t0 = time.perf_counter()
        holder["f"].result()
        dist.barrier()
        add("dcp async_save total", res["dcp async_save blocking"][-1] + time.perf_counter() - t0)
        add("dcp load", timed(lambda: dcp.load(state, checkpoint_id=f"{d}/dcp-sync")))
        # --- torch.save / torch.load (each rank its local shard)
        tpath = f"{d}/torch-{rank}.pt"
        add("torch.save", timed(lambda: torch.save(local, tpath)))
        add("torch.load", timed(lambda: torch.load(tpath, weights_only=True)))
        # --- safetensors save_file / load_file (each rank its local shard)
        spath = f"{d}/st-{rank}.safetensors"
        add("safetensors save", timed(lambda: safetensors.torch.save_file(local, spath)))
        add("safetensors load", timed(lambda: safetensors.torch.load_file(spath)))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)

    for rep in range(args.repeat):
        one_repetition(f"{base}/rep{rep}")
    saver_async.close()
    if rank == 0:
        pick = min if args.stat == "best" else statistics.median
        q.put({"results": {k: pick(v) for k, v in res.items()}, "raw": res, "local_bytes": local_bytes})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--stat", choices=("median", "best"), default="median")
    p.add_argument("--dir", default="/tmp/ckpt-bench")
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, port, args, q)) for r in range(args.ranks)]
    for pr in procs:
        pr.start()
    out = q.get()
    for pr in procs:
        pr.join()
    r = out["results"]
    for key in ("ckpt async blocking", "dcp async_save blocking", "memcpy"):
        print(f"  {key} per repetition: " + ", ".join(f"{v:.3f}" for v in out["raw"][key]))
    gib_local = out["local_bytes"] / (1 << 30)
    rows = [
        ("async save, blocking", "ckpt async blocking", "dcp async_save blocking"),
        ("async save, total", "ckpt async total", "dcp async_save total"),
        ("sync save", "ckpt save", "dcp save"),
        ("load", "ckpt load", "dcp load"),
    ]
    print(
        f"state: {args.gib:.2f} GiB over {args.ranks} ranks ({gib_local:.2f} GiB per rank), {args.stat} of {args.repeat}"
    )
    print(f"{'operation':24} {'ckpt s':>9} {'DCP s':>9} {'ckpt/DCP':>9}")
    table = []
    for label, ours, theirs in rows:
        ratio = r[ours] / r[theirs]
        print(f"{label:24} {r[ours]:9.3f} {r[theirs]:9.3f} {ratio:9.2f}")
        table.append({"operation": label, "ckpt_s": r[ours], "dcp_s": r[theirs], "ratio": ratio})
    print(f"{'torch.save / load':24} {r['torch.save']:9.3f} {r['torch.load']:9.3f}")
    print(f"{'safetensors save / load':24} {r['safetensors save']:9.3f} {r['safetensors load']:9.3f}")
    print(
        f"one memory copy: {r['memcpy']:.3f} s -> async blocking = {r['ckpt async blocking'] / r['memcpy']:.2f}x copy"
    )
    bw_w = gib_local * args.ranks / r["raw write"]
    bw_r = gib_local * args.ranks / r["raw read"]
    print(
        f"raw write {r['raw write']:.3f} s ({bw_w:.2f} GiB/s), raw read {r['raw read']:.3f} s ({bw_r:.2f} GiB/s)"
    )
    print(
        f"ckpt sync save = {r['raw write'] / r['ckpt save']:.2f}x raw write bandwidth, "
        f"load = {r['raw read'] / r['ckpt load']:.2f}x raw read bandwidth"
    )
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "save_load.json"), "w") as f:
        json.dump({"args": vars(args), "seconds": r, "table": table}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
