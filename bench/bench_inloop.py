"""What a checkpoint costs the training *step*, in the loop (issue 28).  Every saver, same state, same run.

    .venv/bin/python bench/bench_inloop.py [--sizes 0.25,0.75,2] [--every 1,10] [--rounds 2]
    .venv/bin/python bench/bench_inloop.py --profile [--sizes 0.25]    # where the background time goes
    .venv/bin/python bench/bench_inloop.py --xla                        # a traced XLA step with a save in flight

A stack of ``Linear`` layers holding fp32 parameters + Adam moments (``--sizes`` GiB in all) trains on one thread
(``torch.set_num_threads(1)``; the other core plays the host's spare CPU).  Savers (``--savers``):

* ``none``: no checkpoints (the baseline of every ratio);
* ``ckpt``: ``Checkpointer(async_save=True)`` as it comes: lazy staging, the shared-memory arena, the persistent
  writer process (``ProcessStager``, the default);
  The writer sends the data file to the disk with direct I/O straight from the arena (no page-cache copy);
* ``ckpt buffered``: the same writer process writing through the page cache (``ProcessStager(direct_io=False)``),
  as before direct I/O;
* ``mem``: the host-memory tier (``CheckpointManager(local_dir="/dev/shm/...", local_memory=True)``, issue 38):
  one copy into a shared-memory arena that becomes the data file in place;
* ``ckpt thread``: the same with ``stager=HostStager()``: the data files written by a thread of the trainer;
* ``dcp``: ``torch.distributed.checkpoint.async_save`` (staging inside the call, writer thread);
* ``dcp stager``: ``async_save`` with one reused ``DefaultStager`` (background staging, waited on before
  ``optimizer.step()``; pinned memory on CUDA);
* ``copy+write``: the floor: a thread copies the state into a reused buffer (waited on before ``step()``), then
  writes it to one file with ``os.write`` and fsyncs it: no format, no checksum.

Each saver saves every ``E`` steps (``--every``) over ``saves x E`` steps (the save at step 1, 1+E, ...; each save
has E steps after it), then waits for its last save: that wait is part of the run's time.  Runs are short and
interleaved (each round runs every saver once, in a rotated order; at E > 1 a run is one save and its E steps by
default) so that drifts of the machine hit all savers alike; rows are medians over rounds, with the quartiles of
the overhead.  Old checkpoints are deleted between runs, off the clock (retention is not the saver's cost: the
manager deletes in the background).
Per run: **overhead per save** = (run time - the same round's ``none`` run time) / saves; **overhead %** = run time
/ ``none`` run time - 1; **background CPU s/GiB** = CPU of every thread but the training one, plus the writer
process's, less the same round's ``none`` run's, per GiB saved; **train CPU** = CPU time of the training thread / the ``none`` run's - 1 (memory bandwidth and
caches it lost to the saver, without the scheduler's delays: steadier than wall time on a shared machine).  Savers are built once per size and warmed with one save (arena first touch, writer
start) before anything is measured: a training job pays those once.

Prints tables and writes ``bench/results/inloop.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from itertools import count
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from bench_stall import DcpSaver, build, finish, state_bytes  # noqa: E402

from ckpt.saving.checkpointer import Checkpointer  # noqa: E402
from ckpt.saving.options import SaveOptions  # noqa: E402
from ckpt.saving.process_writer import ProcessStager  # noqa: E402
from ckpt.saving.staging import HostStager  # noqa: E402

NO_RNG = SaveOptions(rng=False)

GIB = 2**30
_SEQ = count()
TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) of process ``pid`` so far; 0 when there is none."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Run:
    """One saver in the loop; ``before_step`` is what it makes the training thread wait for before step()."""

    name = "none"

    def __init__(self, root: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.root, self.model, self.opt = root, model, opt
        self.dirs: list[str] = []

    def path(self, step: int) -> str:
        p = os.path.join(self.root, f"{self.name.replace(' ', '_')}-{step:08d}-{next(_SEQ)}")
        self.dirs.append(p)
        return p

    def cleanup(self) -> None:
        """Delete this run's checkpoints (between runs, not timed)."""
        self.drain()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.dirs.clear()

    def save(self, step: int) -> None:
        pass

    def before_step(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def child_pid(self) -> int | None:
        return None

    def close(self) -> None:
        self.cleanup()


class CkptRun(Run):
    def __init__(self, root: str, model: Any, opt: Any, name: str) -> None:
        super().__init__(root, model, opt)
        self.name = name
        stager = {
            "ckpt": ProcessStager,
            "ckpt buffered": lambda: ProcessStager(direct_io=False),
            "ckpt thread": HostStager,
        }[name]()
        self.ck = Checkpointer(async_save=True, stager=stager)

    def save(self, step: int) -> None:
        self.ck.save(self.path(step), step=step, model=self.model, optimizer=self.opt, options=NO_RNG)

    def drain(self) -> None:
        self.ck.wait()

    def child_pid(self) -> int | None:
        return getattr(self.ck.stager, "writer_pid", None)

    def close(self) -> None:
        super().close()
        self.ck.close()


class MemRun(Run):
    """The host-memory tier (``CheckpointManager(local_dir=<in /dev/shm>, local_memory=True)``): each save is one
    copy into the shared-memory arena, sealed and linked in place; no persistent copy (``persist_every`` never)."""

    name = "mem"

    def __init__(self, root: str, model: Any, opt: Any) -> None:
        super().__init__(root, model, opt)
        from ckpt.manager import CheckpointManager

        self.shm = tempfile.mkdtemp(prefix="ckpt-bench-mem-", dir="/dev/shm")
        self.mgr = CheckpointManager(root, local_dir=self.shm, local_memory=True, persist_every=10**9)

    def save(self, step: int) -> None:
        self.mgr.save(step, model=self.model, optimizer=self.opt, rng=False)

    def drain(self) -> None:
        self.mgr.wait()

    def child_pid(self) -> int | None:
        return getattr(self.mgr.checkpointer.stager, "writer_pid", None)

    def close(self) -> None:
        self.mgr.close()
        shutil.rmtree(self.shm, ignore_errors=True)


class DcpRun(Run):
    def __init__(self, root: str, model: Any, opt: Any, stager: bool, cuda: bool) -> None:
        super().__init__(root, model, opt)
        self.name = "dcp stager" if stager else "dcp"
        self.inner = DcpSaver(root, model, opt, stager=stager, cuda=cuda)

    def save(self, step: int) -> None:
        self.inner.save(step)
        # ours to delete between runs: DcpSaver's drain would delete on the clock
        self.dirs.extend(self.inner.dirs)
        self.inner.dirs.clear()

    def before_step(self) -> None:
        self.inner.before_step()

    def drain(self) -> None:
        self.inner._drain()

    def close(self) -> None:
        self.inner.close()
        self.cleanup()


class CopyWriteRun(Run):
    """The floor any saver pays: one copy of the state into a reused buffer, then one sequential write + fsync."""

    name = "copy+write"

    def __init__(self, root: str, model: Any, opt: Any) -> None:
        super().__init__(root, model, opt)
        self.tensors = [p for p in model.parameters()] + [
            v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        n = sum(t.numel() * t.element_size() for t in self.tensors)
        pinned = any(t.is_cuda for t in self.tensors)
        self.buf = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
        self.copied = threading.Event()
        self.thread: threading.Thread | None = None
        self.copy_cpu: list[float] = []

    def _work(self, path: str) -> None:
        c0 = time.thread_time()
        pos = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            self.buf[pos : pos + n].view(t.dtype).view(t.shape).copy_(t.detach())
            pos += n
        if self.buf.is_pinned():
            torch.cuda.synchronize()
        self.copied.set()
        view = memoryview(self.buf.numpy())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done : done + (64 << 20)])
            os.fsync(fd)
        finally:
            os.close(fd)
        self.copy_cpu.append(time.thread_time() - c0)

    def save(self, step: int) -> None:
        self.drain()
        p = self.path(step)
        os.makedirs(p)
        self.copied.clear()
        self.thread = threading.Thread(target=self._work, args=(os.path.join(p, "state.bin"),), daemon=True)
        self.thread.start()

    def before_step(self) -> None:
        if self.thread is not None:
            self.copied.wait()

    def drain(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def train(
    model: Any, opt: Any, x: torch.Tensor, run: Run, steps: int, every: int, sync: Any
) -> dict[str, float]:
    """``steps`` steps, a save after steps 1, 1+every, ...; then wait for the last save.  Times and CPU."""
    pid0 = run.child_pid()
    child0 = proc_cpu(pid0)
    t0, p0, c0 = time.perf_counter(), self_cpu(), time.thread_time()
    saves = 0
    for i in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        run.before_step()
        opt.step()
        sync()
        if (i - 1) % every == 0 and run.name != "none":
            run.save(i)
            saves += 1
    run.drain()
    sync()
    wall = time.perf_counter() - t0
    own = time.thread_time() - c0
    pid = run.child_pid()
    child = proc_cpu(pid) - (child0 if pid == pid0 else 0.0)
    return {"wall": wall, "saves": saves, "bg_cpu": self_cpu() - p0 - own + child, "train_cpu": own}


def summarize(
    per: dict[str, list[dict[str, float]]], nbytes: int, steps: int
) -> tuple[dict[str, Any], float | None]:
    """Each saver's row (medians over rounds of the ratios against the same round's ``none`` run) and the step time
    without checkpoints, from the runs of one size and one save interval."""
    rows: dict[str, Any] = {}
    for n in per:
        ovh, pct = [], []
        for rnd, res in enumerate(per[n]):
            base = per["none"][rnd]["wall"] if "none" in per else float("nan")
            if n != "none":
                ovh.append((res["wall"] - base) / res["saves"])
                pct.append(res["wall"] / base - 1)
        tc = [
            res["train_cpu"] / per["none"][rnd]["train_cpu"] - 1
            for rnd, res in enumerate(per[n])
            if "none" in per and n != "none"
        ]
        bg = [  # less what the other threads do without checkpoints (the same round's none run)
            (r["bg_cpu"] - (per["none"][rnd]["bg_cpu"] if "none" in per else 0.0))
            / (r["saves"] * nbytes / GIB)
            for rnd, r in enumerate(per[n])
            if r["saves"]
        ]
        rows[n] = {
            "runs": per[n],
            "overhead_per_save_s": statistics.median(ovh) if ovh else 0.0,
            "overhead_per_save_q1_q3": quartiles(ovh),
            "overhead_pct": statistics.median(pct) if pct else 0.0,
            "train_cpu_overhead_pct": statistics.median(tc) if tc else 0.0,
            "bg_cpu_s_per_gib": statistics.median(bg) if bg else 0.0,
        }
    step_s = statistics.median(r["wall"] for r in per["none"]) / steps if "none" in per else None
    for n, row in rows.items():
        for ref in ("dcp", "dcp stager"):
            d = rows.get(ref, {}).get("overhead_per_save_s")
            row[f"vs_{ref.replace(' ', '_')}"] = row["overhead_per_save_s"] / d if d and n != "none" else None
        cw = rows.get("copy+write", {}).get("bg_cpu_s_per_gib")
        row["bg_cpu_vs_copy_write"] = row["bg_cpu_s_per_gib"] / cw if cw and n != "none" else None
    return rows, step_s


def quartiles(xs: list[float]) -> list[float] | None:
    """The first and third quartiles of ``xs`` (the spread over rounds), None below 3 values."""
    if len(xs) < 3:
        return None
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]


def make(name: str, root: str, model: Any, opt: Any, cuda: bool) -> Run:
    os.makedirs(root, exist_ok=True)
    if name == "none":
        return Run(root, model, opt)
    if name in ("ckpt", "ckpt buffered", "ckpt thread"):
        return CkptRun(root, model, opt, name)
    if name == "mem":
        return MemRun(root, model, opt)
    if name in ("dcp", "dcp stager"):
        return DcpRun(root, model, opt, stager=name == "dcp stager", cuda=cuda)
    if name == "copy+write":
        return CopyWriteRun(root, model, opt)
    raise SystemExit(f"bench_inloop: error: unknown saver {name!r}")


def width_for(gib: float) -> int:
    return 1024 if gib <= 0.3 else 2048 if gib <= 1.0 else 4096


def measure(args: argparse.Namespace, gib: float, work: str, cuda: bool) -> dict[str, Any]:
    device = args.device
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, opt = build(int(gib * 1024), width_for(gib), device)
    x = torch.randn(args.batch, width_for(gib), device=device)
    for _ in range(2):  # Adam state exists, kernels warm
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    nbytes = state_bytes(model, opt)
    names = [s.strip() for s in args.savers.split(",") if s.strip()]
    runs = {
        n: make(n, os.path.join(work, n.replace(" ", "_").replace("+", "_")), model, opt, cuda) for n in names
    }
    for (
        r
    ) in runs.values():  # warm: arenas' first touch (two for mem), writer start, DCP's first-save planning
        train(model, opt, x, r, 2, 1, sync)
        r.cleanup()
    out: dict[str, Any] = {"state_bytes": nbytes, "by_every": {}}
    for every in args.every:
        saves = args.saves_every_step if every == 1 else args.saves
        steps = saves * every
        per: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for rnd in range(args.rounds):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for n in order:
                res = train(model, opt, x, runs[n], steps, every, sync)
                runs[n].cleanup()
                per[n].append(res)
                print(
                    f"  {gib} GiB every {every}: {n:13} {res['wall']:7.2f} s  bg CPU {res['bg_cpu']:.2f} s",
                    flush=True,
                )
        rows, step_s = summarize(per, nbytes, steps)
        out["by_every"][str(every)] = {"steps": steps, "saves": saves, "step_s": step_s, "savers": rows}
    for r in runs.values():
        r.close()
    del model, opt
    return out


def spread(q: list[float] | None) -> str:
    return "-" if not q else f"({q[0]:.3f}, {q[1]:.3f})"


def print_tables(results: dict[str, Any]) -> None:
    for size, res in results["sizes"].items():
        for every, e in res["by_every"].items():
            print(
                f"\n{size} GiB ({res['state_bytes'] / GIB:.2f} GiB state), save every {every} step(s), "
                f"{e['saves']} saves over {e['steps']} steps; step without checkpoints {e['step_s']:.3f} s"
            )
            print(
                f"{'saver':14} {'ovh/save s':>10} {'(q1, q3)':>15} {'ovh %':>7} {'vs dcp':>7} {'vs stager':>9} "
                f"{'bg CPU s/GiB':>12} {'vs copy+write':>13} {'train CPU':>9}"
            )
            for n, r in e["savers"].items():
                if n == "none":
                    continue

                def f(v: Any, fmt: str) -> str:
                    return "-" if v is None else format(v, fmt)

                print(
                    f"{n:14} {r['overhead_per_save_s']:10.3f} {spread(r.get('overhead_per_save_q1_q3')):>15} "
                    f"{r['overhead_pct'] * 100:6.1f}% "
                    f"{f(r['vs_dcp'], '7.2f'):>7} {f(r['vs_dcp_stager'], '9.2f'):>9} "
                    f"{r['bg_cpu_s_per_gib']:12.3f} {f(r['bg_cpu_vs_copy_write'], '13.2f'):>13} "
                    f"{r['train_cpu_overhead_pct'] * 100:8.1f}%"
                )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes", default="0.25", help="GiB of params + Adam state, comma-separated (issue: 0.25,0.75,2)"
    )
    p.add_argument("--every", default="1,10", help="save every N steps, comma-separated")
    p.add_argument("--saves", type=int, default=1, help="saves per run at every > 1")
    p.add_argument("--saves-every-step", type=int, default=4, help="saves per run at every = 1")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch", type=int, default=8, help="rows per step (sets the forward/backward time)")
    p.add_argument("--savers", default="none,ckpt,ckpt buffered,ckpt thread,dcp,dcp stager,copy+write")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument(
        "--profile", action="store_true", help="the background-work breakdown (bench/inloop_profile.py)"
    )
    p.add_argument("--xla", action="store_true", help="a traced XLA step with a save in flight vs without")
    p.add_argument("--out", default=None)
    p.add_argument("--table", default=None, help="recompute and print the tables of a results JSON; no run")
    args = p.parse_args()
    args.every = [int(v) for v in args.every.split(",")]
    if args.table:
        with open(args.table) as f:
            results = json.load(f)
        for res in results["sizes"].values():
            for e in res["by_every"].values():
                per = {n: r["runs"] for n, r in e["savers"].items()}
                e["savers"], e["step_s"] = summarize(per, res["state_bytes"], e["steps"])
        print_tables(results)
        return 0
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)  # DCP: "overwriting", "TypedStorage"
    if args.profile or args.xla:
        import inloop_profile

        return inloop_profile.main(args)
    cuda = args.device.startswith("cuda")
    if not dist.is_initialized():  # DCP's async_save wants a process group; one gloo rank
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    work = args.dir or tempfile.mkdtemp(prefix="ckpt-inloop-")
    results: dict[str, Any] = {
        "device": args.device,
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items()},
        "load_before": os.getloadavg(),
        "sizes": {},
    }
    for gib in [float(v) for v in args.sizes.split(",")]:
        results["sizes"][str(gib)] = measure(args, gib, work, cuda)
    results["load_after"] = os.getloadavg()
    print_tables(results)
    print(f"\nload average before / after: {results['load_before']} / {results['load_after']}")
    finish(results, args.out or os.path.join(HERE, "results", "inloop.json"), work, keep=bool(args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
