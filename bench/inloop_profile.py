"""The profile behind bench/bench_inloop.py (``--profile``) and its XLA measurement (``--xla``).

``--profile``: where a save's background time goes, per GiB, on one thread each: a torch copy into a warm buffer
(the staging copy), xxh3-64 of a buffer cold from memory and of blocks still in the CPU cache (the hash in the same
pass as the write), a write into the page cache, a direct (``O_DIRECT``) write from a page-aligned buffer, fsync;
then whole saves of the model (ckpt's writer thread, the
writer process through the page cache and with direct I/O) with the training thread idle and a GIL probe thread: it sleeps 0.2 ms in a loop and adds up how
late it wakes (waiting for the GIL, or for a core), against the same probe with no save in flight.

``--xla``: a small model on the XLA device (PJRT CPU), one traced step = forward, backward, ``optimizer.step()``,
``mark_step`` and a wait for the device; mean step time with a ckpt async save in flight (a save every 2 steps)
against the same loop without saves, interleaved.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

import torch
import xxhash
from bench_inloop import GIB, HERE, proc_cpu, self_cpu
from bench_stall import build, state_bytes

from ckpt.format.streamwrite import HASH_WRITE_BLOCK
from ckpt.saving.checkpointer import Checkpointer
from ckpt.saving.options import SaveOptions
from ckpt.saving.process_writer import ProcessStager
from ckpt.saving.staging import HostStager

NO_RNG = SaveOptions(rng=False)
# the default (writer process, direct I/O), the writer process through the page cache, the in-process writer
STAGERS: dict[str, Any] = {
    "ckpt thread": HostStager,
    "ckpt buffered": lambda: ProcessStager(direct_io=False),
    "ckpt": ProcessStager,
}


class Probe:
    """A thread that sleeps ``period`` s in a loop and sums how late it wakes up (GIL or core not available)."""

    def __init__(self, period: float = 0.0002) -> None:
        self.period, self.late, self.wakes = period, 0.0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            time.sleep(self.period)
            self.late += max(0.0, time.perf_counter() - t0 - self.period)
            self.wakes += 1

    def __enter__(self) -> Probe:
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.wall = time.perf_counter() - self.t0


def per_gib(fn: Any, nbytes: int, repeat: int = 3) -> float:
    """Best-of-``repeat`` seconds of ``fn()`` on this thread, per GiB of ``nbytes``."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best / (nbytes / GIB)


def micro(nbytes: int, work: str) -> dict[str, float]:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    view = memoryview(dst.view(torch.uint8).numpy())
    block = HASH_WRITE_BLOCK
    path = os.path.join(work, "micro.bin")

    def write(sync: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for i in range(0, len(view), 64 << 20):
            os.write(fd, view[i : i + (64 << 20)])
        if sync:
            os.fsync(fd)
        os.close(fd)

    def hash_then_write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for i in range(0, len(view), block):
            b = view[i : i + block]
            xxhash.xxh3_64(b)
            os.write(fd, b)
        os.close(fd)

    aligned = mmap.mmap(-1, nbytes)  # page-aligned, as the writer process's arena is
    aligned[:] = view

    def write_direct(sync: bool) -> None:  # O_DIRECT: the disk reads the buffer by DMA, no page-cache copy
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        for i in range(0, nbytes, 8 << 20):
            os.write(fd, memoryview(aligned)[i : i + (8 << 20)])
        if sync:
            os.fsync(fd)
        os.close(fd)

    res = {
        "copy_s_per_gib": per_gib(lambda: dst.copy_(src), nbytes),
        "xxh3_cold_s_per_gib": per_gib(lambda: xxhash.xxh3_64(view), nbytes),
        "write_page_cache_s_per_gib": per_gib(lambda: write(False), nbytes),
        "hash_in_write_pass_s_per_gib": per_gib(hash_then_write, nbytes),
    }
    res["write_direct_s_per_gib"] = per_gib(lambda: write_direct(False), nbytes)
    t0 = time.perf_counter()
    write(True)
    res["write_fsync_wall_s_per_gib"] = (time.perf_counter() - t0) / (nbytes / GIB)
    t0 = time.perf_counter()
    write_direct(True)
    res["write_direct_fsync_wall_s_per_gib"] = (time.perf_counter() - t0) / (nbytes / GIB)
    res["copy_gib_per_s"] = 1 / res["copy_s_per_gib"]
    os.unlink(path)
    return res


def saves(gib: float, work: str) -> dict[str, Any]:
    model, opt = build(int(gib * 1024), 1024 if gib <= 0.3 else 2048, "cpu")
    model(torch.randn(2, model[0].in_features)).sum().backward()
    opt.step()
    nbytes = state_bytes(model, opt)
    out: dict[str, Any] = {"state_bytes": nbytes}
    with Probe() as idle:
        time.sleep(2.0)
    out["probe_idle_late_ms_per_s"] = idle.late / idle.wall * 1e3
    for name, stager in STAGERS.items():
        ck = Checkpointer(async_save=True, stager=stager())
        ck.save(os.path.join(work, name, "warm"), step=0, model=model, optimizer=opt, options=NO_RNG).result()
        rows = []
        for i in range(3):
            pid = getattr(ck.stager, "writer_pid", None)
            c0, p0, t0 = proc_cpu(pid), self_cpu(), time.thread_time()
            with Probe() as probe:
                ck.save(
                    os.path.join(work, name, str(i)), step=i + 1, model=model, optimizer=opt, options=NO_RNG
                )
                ck.staged()  # the copy (as the next optimizer.step() would)
                ck.wait()
            bg = self_cpu() - p0 - (time.thread_time() - t0) + proc_cpu(pid) - c0
            rows.append(
                {
                    "wall_s": probe.wall,
                    "bg_cpu_s_per_gib": bg / (nbytes / GIB),
                    "probe_late_ms_per_s": probe.late / probe.wall * 1e3,
                    "probe_wakes": probe.wakes,
                }
            )
            shutil.rmtree(os.path.join(work, name, str(i)), ignore_errors=True)
        ck.close()
        out[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out[name]["runs"] = rows
    return out


def xla(args: argparse.Namespace, work: str) -> dict[str, Any]:
    import torch_xla.core.xla_model as xm

    dev = xm.xla_device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    x = torch.randn(args.batch, 1024, device=dev)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        xm.mark_step()
        xm.wait_device_ops()
        return time.perf_counter() - t0

    for _ in range(3):  # traced and compiled once
        step()
    res: dict[str, Any] = {"state_mib": sum(p.numel() * 12 for p in model.parameters()) / 2**20}
    for name, stager in STAGERS.items():
        ck = Checkpointer(async_save=True, stager=stager())
        ck.save(
            os.path.join(work, "xla", name, "warm"), step=0, model=model, optimizer=opt, options=NO_RNG
        ).result()
        plain, inflight, in_save = [], [], []
        for r in range(args.rounds * 3):
            plain += [step() for _ in range(2)]
            t0 = time.perf_counter()
            ck.save(
                os.path.join(work, "xla", name, str(r)),
                step=r + 1,
                model=model,
                optimizer=opt,
                options=NO_RNG,
            )
            in_save.append(time.perf_counter() - t0)
            inflight.append(step())  # the step right after save(): the background write is in flight
            ck.wait()
            inflight[-1] = inflight[-1]
            shutil.rmtree(os.path.join(work, "xla", name, str(r)), ignore_errors=True)
        ck.close()
        res[name] = {
            "step_s_no_save": statistics.median(plain),
            "step_s_save_in_flight": statistics.median(inflight),
            "ratio": statistics.median(inflight) / statistics.median(plain),
            "save_call_s": statistics.median(in_save),
        }
        print(f"xla {name}: {json.dumps(res[name])}", flush=True)
    return res


def main(args: argparse.Namespace) -> int:
    work = args.dir or tempfile.mkdtemp(prefix="ckpt-inloop-prof-")
    results: dict[str, Any] = {"load_before": os.getloadavg()}
    if args.xla:
        results["xla"] = xla(args, work)
    else:
        gib = float(args.sizes.split(",")[0])
        results["micro"] = micro(int(gib * GIB) // 4 * 4, work)
        print(json.dumps(results["micro"], indent=1), flush=True)
        results["saves"] = saves(gib, work)
        print(json.dumps({k: v for k, v in results["saves"].items()}, indent=1, default=str))
    results["load_after"] = os.getloadavg()
    out = args.out or os.path.join(HERE, "results", "inloop_xla.json" if args.xla else "inloop_profile.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0
