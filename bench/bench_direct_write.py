"""What writing a saved byte costs the writing process: buffered ``write`` + ``fsync`` against ``O_DIRECT`` from a
page-aligned buffer (how the writer process writes from its arena: ckpt/format/directwrite.py).

    .venv/bin/python bench/bench_direct_write.py [--mib 1024] [--rounds 3] [--dir DIR]

One buffer in a ``memfd`` mapping (as the shared arena is), written to one file in 4 MiB writes, three ways per
round, interleaved: buffered + fsync; ``O_DIRECT`` + fsync; buffered + fsync + ``POSIX_FADV_DONTNEED`` (dropping the
pages after the fact).  Per GiB: wall seconds, this process's CPU seconds (user + system), and the whole machine's
CPU seconds (``/proc/stat``: kernel writeback threads included).  Writes ``bench/results/direct_write.json``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 4 << 20


def proc_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def machine_cpu() -> float:
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    return sum(int(x) for x in fields[:3]) / os.sysconf("SC_CLK_TCK")  # user, nice, system


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the file goes (default: a temporary folder)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "direct_write.json"))
    args = p.parse_args()
    n = args.mib << 20
    fd = os.memfd_create("bench-arena")
    os.ftruncate(fd, n)
    buf = mmap.mmap(fd, n)
    buf[:] = os.urandom(1 << 20) * args.mib
    view = memoryview(buf)
    work = args.dir or tempfile.mkdtemp(prefix="ckpt-direct-")
    path = os.path.join(work, "f.bin")

    def write(flags: int, drop: bool) -> None:
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
        try:
            for s in range(0, n, BLOCK):
                os.write(out, view[s : s + BLOCK])
            os.fsync(out)
            if drop:
                os.posix_fadvise(out, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(out)

    ways: dict[str, Callable[[], None]] = {
        "buffered": lambda: write(0, False),
        "direct": lambda: write(os.O_DIRECT, False),
        "buffered + dontneed": lambda: write(0, True),
    }
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in ways}
    gib = n / (1 << 30)
    for r in range(args.rounds):
        for name, fn in ways.items():
            if os.path.exists(path):
                os.unlink(path)
            c0, m0, t0 = proc_cpu(), machine_cpu(), time.perf_counter()
            fn()
            c1, m1, t1 = proc_cpu(), machine_cpu(), time.perf_counter()
            row = {
                "wall_s_per_gib": (t1 - t0) / gib,
                "cpu_s_per_gib": (c1 - c0) / gib,
                "machine_cpu_s_per_gib": (m1 - m0) / gib,
            }
            rows[name].append(row)
            print(f"round {r} {name:20s} " + "  ".join(f"{k} {v:5.2f}" for k, v in row.items()), flush=True)
    os.unlink(path)
    if not args.dir:
        os.rmdir(work)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"mib": args.mib, "load": os.getloadavg(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
