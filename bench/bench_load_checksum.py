"""Local load with checksums vs a raw read of the same bytes, one process, interleaved, in the same run.

    .venv/bin/python bench/bench_load_checksum.py [--gib 0.5] [--repeat 7] [--dir /tmp/ckpt-bench-load]

Measures ``ckpt.restore`` of a --gib GiB state (fp32 4096-wide matrices, 8 MiB chunks) from local disk (page
cache): as shipped (each block hashed on a helper thread while the next is read), with hashing inline in the
reading thread (the previous behaviour), and with ``verify=False``; against ``os.readv`` of one file holding the
same bytes into the same tensors. Reports minima and medians of wall time and the process's CPU seconds (on a
shared machine the CPU figures say what the work costs, the wall figures what a free machine would see only when
quiet). Torch intra-op threads are 1. Writes bench/results/load_checksum.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=0.5)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--dir", default="/tmp/ckpt-bench-load")
    p.add_argument("--out", default=os.path.join(HERE, "results", "load_checksum.json"))
    args = p.parse_args()
    import torch

    import ckpt
    import ckpt.format.batchread as batchread

    torch.set_num_threads(1)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    total = 0
    while total < args.gib * (1 << 30):
        t = torch.randn(4096 if len(state) % 3 else 1024, 4096, generator=g)
        state[f"layers.{len(state)}.weight"] = t
        total += t.numel() * 4
    path = os.path.join(args.dir, "ckpt")
    ckpt.save(path, step=1, model=state, rng=False)
    raw = os.path.join(args.dir, "raw.bin")
    with open(raw, "wb") as f:
        for t in state.values():
            f.write(t.numpy().tobytes())
    back = {k: torch.empty_like(v) for k, v in state.items()}

    def raw_read() -> None:
        fd = os.open(raw, os.O_RDONLY)
        for t in back.values():
            os.readv(fd, [t.reshape(-1).view(torch.uint8).numpy()])
        os.close(fd)

    def inline() -> None:
        saved = batchread.INLINE_HASH_BYTES
        batchread.INLINE_HASH_BYTES = 1 << 62  # every read hashed by the thread that reads it
        try:
            ckpt.restore(path, model=back, rng=False)
        finally:
            batchread.INLINE_HASH_BYTES = saved

    methods = {
        "raw read": raw_read,
        "ckpt load": lambda: ckpt.restore(path, model=back, rng=False),
        "ckpt load, hash inline": inline,
        "ckpt load, verify=False": lambda: ckpt.restore(path, model=back, rng=False, verify=False),
    }
    wall: dict[str, list[float]] = {k: [] for k in methods}
    cpu: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(args.repeat):
        for name, fn in methods.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    best = {k: min(v) for k, v in wall.items()}
    out = {
        "args": vars(args),
        "bytes": total,
        "cpus": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg(),
        "wall_min": best,
        "wall_median": {k: statistics.median(v) for k, v in wall.items()},
        "cpu_median": {k: statistics.median(v) for k, v in cpu.items()},
        "bandwidth_vs_raw_min": {k: best["raw read"] / v for k, v in best.items()},
        "all_wall": wall,
    }
    print(json.dumps({k: v for k, v in out.items() if k != "all_wall"}, indent=2))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
