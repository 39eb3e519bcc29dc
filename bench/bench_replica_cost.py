"""What one replica exchange costs the training process: the copying path before issue 38's follow-up against the
zero-copy :func:`ckpt.tiers.transfer.transfer`, in the same run.

    .venv/bin/python bench/bench_replica_cost.py [--mib 256] [--files 4] [--repeat 5] [--dir /dev/shm/ckpt-bench-rc]

2 gloo ranks on this machine, each with a --mib MiB file set in /dev/shm (--files files), send theirs to each other
(a node's replicas with ``replicas=1``) from a thread of their own, as the tiers' worker thread does, while the
main thread waits, runs pure-Python work, or sleeps in short steps.  Per exchange and rank:

* ``wall_ms``: the exchange from the first call to the last file published (both ranks start after a barrier);
* ``thread_cpu_ms``: the exchanging thread's own CPU time (``time.thread_time``): reads, copies, hashing, Python;
* ``proc_cpu_ms``: the whole process's CPU time but the pure-Python thread's (gloo's threads included);
* ``py_delay_ms`` (rounds ``+py``): how long a pure-Python thread, runnable throughout, did not run during the
  exchange (its wall time minus its CPU time over small fixed chunks of work): the GIL held by the exchange plus
  the time the OS gave its core to another thread (this VM has 2 cores, shared with other jobs, and both ranks
  run on them: a large part of this is core contention, not the GIL);
* ``probe_late_ms`` (rounds ``+probe``): the summed lateness of 0.5 ms sleeps in a loop beside the exchange, less
  their lateness with nothing running (measured first): a thread that needs the GIL only now and then, like a
  training thread whose time is in torch ops; ``probe_late_max_ms`` its longest single wait.

``writer+py`` / ``writer+probe`` run the new path in a process of its own per rank (with its own gloo group), as a
writer process would: what it saves the training thread beyond the new path in a thread is the difference
``new+py`` - ``writer+py`` (``+probe`` alike).  ``hash.send_set_ms``: xxh3 of one rank's file set in place, the
part of the new path's thread CPU that runs without the GIL (once on each side).

Each repeat runs every round kind, after one warm-up repeat; medians over --repeat and both ranks go to
bench/results/replica_cost.json.  "old" is a copy of the functions ``ckpt.tiers.transfer`` had before (read the
file into bytes, copy into a bytearray for ``isend``, receive into ``torch.empty``, ``.numpy().tobytes()``, hash,
``put_bytes``); the manifest check that follows both in the tiers is the same for both and is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# ------------------------------------------------------------------------------------------------ the old path


def old_read_or_zeros(path: Path, size: int, problems: list[str]) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        problems.append(f"{path}: cannot read: {e.strerror or type(e).__name__}")
        return bytes(size)
    if len(data) != size:
        problems.append(f"{path}: {len(data)} bytes, the manifest says {size}")
        return bytes(size)
    return data


def old_exchange(group: Any, sends: list[tuple[int, bytes]], recvs: list[tuple[int, int]]) -> list[bytes]:
    works = []
    for dst, data in sends:
        if len(data):
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            works.append(dist.isend(buf, dst=dst, group=group))
    out: list[torch.Tensor] = []
    for src, size in recvs:
        buf = torch.empty(size, dtype=torch.uint8)
        out.append(buf)
        if size:
            works.append(dist.irecv(buf, src=src, group=group))
    for w in works:
        w.wait()
    return [b.numpy().tobytes() for b in out]


def old_path(
    coll: Any, peer: int, send: Path, recv: Path, mine: list[str], theirs: list[str], size: int
) -> list[str]:
    """The old ``read_or_zeros`` + ``sent_digests`` + ``exchange`` + ``store_received`` (manifest check aside)."""
    from ckpt.format.codecs import checksum
    from ckpt.storage import open_storage

    problems: list[str] = []
    data = [old_read_or_zeros(send / n, size, problems) for n in mine]
    digests: dict[str, str] = {}
    for part in coll.all_gather({n: checksum(d) for n, d in zip(mine, data, strict=True)}):
        digests.update(part)
    got = old_exchange(coll.group, [(peer, d) for d in data], [(peer, size) for _ in theirs])
    storage = open_storage(str(recv))
    for n, data in zip(theirs, got, strict=True):
        if checksum(data) != digests[n]:
            problems.append(f"{recv / n}: damaged in transit")
            continue
        storage.put_bytes(n, data, exclusive=False)
    return problems


def new_path(
    coll: Any, peer: int, send: Path, recv: Path, mine: list[str], theirs: list[str], size: int
) -> list[str]:
    """:func:`ckpt.tiers.transfer.transfer`, as :func:`ckpt.tiers.replicate.send_replicas` calls it."""
    from ckpt.tiers.transfer import Receive, Send, transfer

    got = transfer(
        coll,
        [Send(n, send / n, size, peer) for n in mine],
        [Receive(n, recv / n, size, peer) for n in theirs],
    )
    return got.problems


PATHS: dict[str, Callable[..., list[str]]] = {"old": old_path, "new": new_path}
#: the rounds of each repeat: (path, run by a thread or a writer process, what the main thread does meanwhile)
ROUNDS = {
    "old": ("old", "thread", ""),
    "new": ("new", "thread", ""),
    "old+py": ("old", "thread", "py"),
    "new+py": ("new", "thread", "py"),
    "writer+py": ("new", "writer", "py"),
    "old+probe": ("old", "thread", "probe"),
    "new+probe": ("new", "thread", "probe"),
    "writer+probe": ("new", "writer", "probe"),
}

# ------------------------------------------------------------------------------------------------ measuring


def _chunk() -> None:
    """About 50 us of pure-Python work (holds the GIL throughout)."""
    x = 0
    for i in range(600):
        x += i * i


PROBE_IDLE_LAG = [0.0]  # the probe's mean lateness per sleep with nothing else running (timer slack)


def hash_ms(folder: Path, names: list[str]) -> float:
    """Milliseconds to xxh3 the files ``names`` where they lie (mapped), as :mod:`ckpt.tiers.outgoing` does: the
    part of the new path's thread CPU that runs without the GIL (xxhash releases it), once per side."""
    import mmap

    from ckpt.format.codecs import checksum

    t0 = time.perf_counter()
    for n in names:
        with open(folder / n, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
            with memoryview(mm) as view:
                checksum(view)
    return (time.perf_counter() - t0) * 1e3


def probe_idle_lag(n: int = 1000) -> float:
    """Mean lateness of a 0.5 ms sleep on this machine now, nothing of ours running beside it."""
    t0 = time.perf_counter()
    for _ in range(n):
        time.sleep(0.0005)
    return (time.perf_counter() - t0) / n - 0.0005


class InThread:
    """The exchange in a thread of the training process, as the tiers run it today."""

    def __init__(self, coll: Any) -> None:
        self.coll = coll

    def start(self, fn: Callable[..., list[str]], *args: Any) -> Callable[[], dict[str, Any] | None]:
        box: dict[str, Any] = {}

        def run() -> None:
            c0, t0 = time.thread_time(), time.perf_counter()
            problems = fn(self.coll, *args)
            box.update(problems=problems, wall=time.perf_counter() - t0, cpu=time.thread_time() - c0)

        th = threading.Thread(target=run, name="exchange")
        th.start()
        return lambda: (th.join(), box)[1] if not th.is_alive() else None


class InWriter:
    """The exchange in a process of its own per rank (a writer process with its own gloo group): what the
    training process would still pay is core contention, never the GIL."""

    def __init__(self, rank: int, port: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_writer, args=(rank, port, theirs), daemon=True)
        self.proc.start()
        assert self.conn.recv() == "ready"

    def start(self, fn: Callable[..., list[str]], *args: Any) -> Callable[[], dict[str, Any] | None]:
        self.conn.send((fn.__name__, args))
        return lambda: self.conn.recv() if self.conn.poll() else None

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join()


def _writer(rank: int, port: int, conn: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from ckpt.distributed import Collective

    coll = Collective(dist.new_group(backend="gloo"))
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        name, args = msg
        coll.barrier()
        c0, t0 = time.thread_time(), time.perf_counter()
        problems = PATHS[name.removesuffix("_path")](coll, *args)
        conn.send({"problems": problems, "wall": time.perf_counter() - t0, "cpu": time.thread_time() - c0})
    dist.destroy_process_group()


def one_exchange(runner: Any, beside: str, fn: Callable[..., list[str]], *args: Any) -> dict[str, float]:
    """``fn(coll, *args)`` by ``runner`` while this thread runs ``beside``: "py", :func:`_chunk` in a loop (a
    training thread's Python); "probe", 0.5 ms sleeps, each one's lateness timed (a thread that needs the GIL only
    now and then: its lateness is the GIL held by someone else, or a core it has to wait for); "" nothing."""
    dist.barrier()
    p0 = time.process_time()
    tc0 = time.thread_time()
    done = runner.start(fn, *args)
    off_cpu = late = late_max = 0.0
    sleeps = 0
    while (box := done()) is None:
        if beside == "py":
            w0, c0 = time.perf_counter(), time.thread_time()
            _chunk()
            off_cpu += (time.perf_counter() - w0) - (time.thread_time() - c0)
        elif beside == "probe":
            w0 = time.perf_counter()
            time.sleep(0.0005)
            lag = time.perf_counter() - w0 - 0.0005
            late, late_max, sleeps = late + lag, max(late_max, lag), sleeps + 1
        else:
            time.sleep(0.0005)
    ticker_cpu = time.thread_time() - tc0
    assert box["problems"] == [], box["problems"]
    row = {"wall_ms": box["wall"] * 1e3, "thread_cpu_ms": box["cpu"] * 1e3}
    if isinstance(runner, InThread):
        row["proc_cpu_ms"] = (time.process_time() - p0 - ticker_cpu) * 1e3
    if beside == "py":
        row["py_delay_ms"] = off_cpu * 1e3
    if beside == "probe":
        row["probe_late_ms"] = max(0.0, late - sleeps * PROBE_IDLE_LAG[0]) * 1e3
        row["probe_late_max_ms"] = late_max * 1e3
    return row


def _worker(rank: int, world: int, ports: tuple[int, int], args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ckpt.distributed import Collective

    runners = {
        "thread": InThread(Collective(dist.new_group(backend="gloo"))),
        "writer": InWriter(rank, ports[1]),
    }
    peer = 1 - rank
    root = Path(args.dir) / f"rank{rank}"
    send = root / "send"
    send.mkdir(parents=True)
    size = (args.mib << 20) // args.files
    names = [f"data_{rank}_{i}.bin" for i in range(args.files)]
    g = torch.Generator().manual_seed(rank)
    for n in names:
        (send / n).write_bytes(
            torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy().tobytes()
        )
    peer_names = [f"data_{peer}_{i}.bin" for i in range(args.files)]
    dist.barrier()
    PROBE_IDLE_LAG[0] = probe_idle_lag()
    hashing = statistics.median(hash_ms(send, names) for _ in range(3))
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in ROUNDS}
    for i in range(args.repeat + 1):
        for mode, (path, where, beside) in ROUNDS.items():
            recv = root / f"recv_{mode}_{i}"
            recv.mkdir()
            row = one_exchange(runners[where], beside, PATHS[path], peer, send, recv, names, peer_names, size)
            assert sorted(os.listdir(recv)) == peer_names  # every file published, no temp file left
            shutil.rmtree(recv)
            if i:  # the first round is the warm-up
                rows[mode].append(row)
    runners["writer"].close()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(
        gathered, {"rows": rows, "hash_ms": hashing, "probe_idle_lag_ms": PROBE_IDLE_LAG[0] * 1e3}
    )
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


COMPARED = [("old", "new"), ("old+py", "new+py"), ("old+probe", "new+probe")]
COMPARED += [("new+py", "writer+py"), ("new+probe", "writer+probe")]


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Medians over repeats and both ranks per round kind, and old / new of each."""
    out: dict[str, dict[str, float]] = {
        "hash": {"send_set_ms": statistics.median(r["hash_ms"] for r in per_rank)}
    }
    for mode in ROUNDS:
        rows = [r for ranks in per_rank for r in ranks["rows"][mode]]
        out[mode] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    for a, b in COMPARED:
        out[f"{a} / {b}"] = {k: out[a][k] / max(out[b][k], 1e-9) for k in out[a] if k in out[b]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm/ckpt-bench-rc")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    out = os.path.join(args.dir, "result.json")
    load_before = os.getloadavg()
    try:
        mp.spawn(_worker, args=(2, tuple(ports), args, out), nprocs=2, join=True)
        per_rank = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    res = {
        "command": "bench/bench_replica_cost.py " + " ".join(sys.argv[1:]),
        "mib_per_rank": args.mib,
        "files_per_rank": args.files,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "median": summarize(per_rank),
        "per_rank": per_rank,
    }
    os.makedirs(Path(__file__).parent / "results", exist_ok=True)
    (Path(__file__).parent / "results" / "replica_cost.json").write_text(json.dumps(res, indent=1))
    med = res["median"]
    print(
        f"xxh3 of one rank's file set, in place: {med['hash']['send_set_ms']:.1f} ms (each side hashes it once)"
    )
    for mode in ROUNDS:
        print(f"{mode:12s}", "  ".join(f"{k} {v:7.1f}" for k, v in med[mode].items()))
    for a, b in COMPARED:
        k = f"{a} / {b}"
        print(f"{k}:", "  ".join(f"{n} {v:.1f}x" for n, v in med[k].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
