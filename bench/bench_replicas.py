"""Cost of comparing replicated state across ranks before saving (issue 9), in the same run.

    .venv/bin/python bench/bench_replicas.py [--mib 256] [--ranks 2] [--repeat 3] [--dir /tmp/ckpt-bench-replicas]

Each of --ranks gloo processes holds the same --mib MiB model (DDP-style: every tensor replicated on every rank,
the worst case for the check: every byte is hashed on every rank).  One Checkpointer saves it --repeat times with
``verify_replicas=False`` and --repeat times with ``verify_replicas=True`` (interleaved, after one warm-up save);
times are minima on rank 0 between barriers.  Prints the ratio checked / unchecked and writes
bench/results/replicas.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckpt import SaveOptions


def _model(mib: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Module()
    rows = max(1, (mib << 20) // (4096 * 4) // 16)
    for i in range(16):
        m.register_buffer(f"w{i}", torch.randn(rows, 4096, generator=g))
    return m


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ckpt import Checkpointer
    from ckpt.saving.replicated import tensor_digest

    model = _model(args.mib)
    ck = Checkpointer()
    ck.save(f"{args.dir}/warm", step=0, model=model).result()  # the first save always checks
    times: dict[str, list[float]] = {"unchecked": [], "checked": []}
    for i in range(args.repeat):
        for mode in ("unchecked", "checked"):
            path = f"{args.dir}/{mode}_{i}"
            dist.barrier()
            t0 = time.perf_counter()
            ck.save(
                path, step=i + 1, model=model, options=SaveOptions(verify_replicas=mode == "checked")
            ).result()
            dist.barrier()
            times[mode].append(time.perf_counter() - t0)
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    t0 = time.perf_counter()
    for t in model.buffers():
        tensor_digest(t)
    hash_s = time.perf_counter() - t0
    if rank == 0:
        nbytes = sum(t.numel() * t.element_size() for t in model.buffers())
        res = {
            "ranks": world,
            "bytes_per_rank": nbytes,
            "unchecked_s": min(times["unchecked"]),
            "checked_s": min(times["checked"]),
            "ratio_checked_over_unchecked": min(times["checked"]) / min(times["unchecked"]),
            "hash_only_s": hash_s,
            "hash_gib_per_s": nbytes / hash_s / (1 << 30),
        }
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    ck.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckpt-bench-replicas")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(args.dir, "result.json")
    mp.spawn(_worker, args=(args.ranks, port, args, out), nprocs=args.ranks, join=True)
    res = json.loads(open(out).read())
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "replicas.json"), "w") as f:
        json.dump(res, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    print(
        f"{res['ranks']} ranks x {res['bytes_per_rank'] / (1 << 20):.0f} MiB replicated: save {res['unchecked_s']:.3f} s, "
        f"with replica check {res['checked_s']:.3f} s (x{res['ratio_checked_over_unchecked']:.2f}); "
        f"hashing alone {res['hash_only_s']:.3f} s ({res['hash_gib_per_s']:.1f} GiB/s per rank)"
    )


if __name__ == "__main__":
    sys.exit(main())
