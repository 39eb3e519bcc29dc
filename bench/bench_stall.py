"""How long does a checkpoint stall training?  One training loop, one state, every saver, same run.

    .venv/bin/python bench/bench_stall.py [--state-mib 256] [--every 4] [--device cpu|cuda]

A stack of ``Linear`` layers holding ``--state-mib`` of fp32 parameters + Adam moments (1/3 each) trains with
``torch.set_num_threads(1)`` (on CPU the second core plays the idle host CPU of a GPU machine).  Each saver runs
the same loop, saving every ``--every`` steps, then every step:

* ``ckpt lazy``: ``CheckpointManager`` async save, lazy staging (the default: copy in the background, step hook);
* ``ckpt eager``: the same with ``lazy=False`` (the whole state copied inside ``save()``);
* ``dcp async_save``: ``torch.distributed.checkpoint.async_save`` (staging inside the call);
* ``dcp DefaultStager``: ``async_save(async_stager=DefaultStager(...))`` (background staging; the loop waits
  for ``staging_completion`` before ``optimizer.step()``, as DCP requires);
* ``nxd-style``: copy every tensor to CPU in the caller, ``torch.save`` on a thread (NxD's async path).

``CPU in save``: CPU time of the training thread inside the save call (``time.thread_time``): the work itself,
without the scheduler's delays on a loaded machine.  ``bg CPU/step``: CPU seconds per step of every other thread
of the process in the save-every-step run (copies, hashing, writes), what competes with training for cores.
Stall per save: time inside the save call plus every wait the saver imposes on the training thread until the
next save (ckpt's step hooks, DCP's staging future, waiting for the previous save to finish).  Overhead: mean step
time with a save every step vs the same loop without checkpoints (measured before and after the savers).
Prints a table and writes ``bench/results/stall.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import ckpt  # noqa: E402


def build(state_mib: int, width: int, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    params = state_mib * 2**20 // 12  # params + exp_avg + exp_avg_sq, fp32
    layers = max(1, round(params / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[m for _ in range(layers) for m in (torch.nn.Linear(width, width, bias=False), torch.nn.ReLU())]
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5, foreach=True)
    return model, opt


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    n += sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return n


class Saver:
    """One way of saving; ``save`` and ``before_step`` return the seconds they held the training thread."""

    name = ""

    def __init__(self, root: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.root, self.model, self.opt = root, model, opt

    def save(self, step: int) -> float:
        raise NotImplementedError

    def before_step(self) -> float:
        return 0.0

    def after_step(self) -> float:
        return 0.0

    def close(self) -> None:
        pass


class CkptSaver(Saver):
    def __init__(self, root: str, model: Any, opt: Any, lazy: bool) -> None:
        super().__init__(root, model, opt)
        self.name = "ckpt lazy" if lazy else "ckpt eager"
        self.lazy = lazy
        self.mgr = ckpt.CheckpointManager(root, keep_last=2, async_save=True)
        self.lazy_bytes = 0

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        self.mgr.save(step, model=self.model, optimizer=self.opt, rng=False, lazy=self.lazy)
        dt = time.perf_counter() - t0
        info = self.mgr.checkpointer.last_staging
        self.lazy_bytes = info.lazy_bytes if info else 0
        return dt

    def before_step(self) -> float:  # the hooks run inside opt.step(); measured by the checkpointer
        return 0.0

    @property
    def hook_s(self) -> float:
        return self.mgr.checkpointer.hook_wait_s

    def close(self) -> None:
        self.mgr.close()


class DcpSaver(Saver):
    def __init__(self, root: str, model: Any, opt: Any, stager: bool, cuda: bool) -> None:
        super().__init__(root, model, opt)
        self.name = "dcp DefaultStager" if stager else "dcp async_save"
        self.stager = stager
        self.cuda = cuda
        self.upload: Any = None
        self.staging: Any = None
        self.dirs: list[str] = []
        self.async_stager: Any = None
        if stager:  # one stager for the whole run: it keeps its (pinned) staging buffers across saves
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.async_stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )

    def _drain(self) -> float:
        t0 = time.perf_counter()
        if self.upload is not None:
            self.upload.result()
            self.upload = None
            while len(self.dirs) > 2:
                shutil.rmtree(self.dirs.pop(0), ignore_errors=True)
        return time.perf_counter() - t0

    def save(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        self._drain()
        msd, osd = get_state_dict(self.model, self.opt)
        path = os.path.join(self.root, f"step_{step:08d}")
        self.dirs.append(path)
        if self.async_stager is not None:
            resp = dcp.async_save(
                {"model": msd, "optim": osd}, checkpoint_id=path, async_stager=self.async_stager
            )
            self.staging, self.upload = resp.staging_completion, resp.upload_completion
        else:
            self.upload = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path)
        return time.perf_counter() - t0

    def before_step(self) -> float:
        t0 = time.perf_counter()
        if self.staging is not None:
            self.staging.result()
            self.staging = None
        return time.perf_counter() - t0

    def close(self) -> None:
        self._drain()
        if self.async_stager is not None:
            self.async_stager.close()


class NxdStyleSaver(Saver):
    name = "nxd-style"

    def __init__(self, root: str, model: Any, opt: Any) -> None:
        super().__init__(root, model, opt)
        self.thread: threading.Thread | None = None
        self.dirs: list[str] = []

    def _drain(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            while len(self.dirs) > 2:
                shutil.rmtree(self.dirs.pop(0), ignore_errors=True)

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        self._drain()
        cpu = {
            "model": {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()},
            "optim": {
                i: {
                    k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                    for k, v in s.items()
                }
                for i, s in self.opt.state_dict()["state"].items()
            },
        }
        path = os.path.join(self.root, f"step_{step:08d}")
        os.makedirs(path, exist_ok=True)
        self.dirs.append(path)
        self.thread = threading.Thread(target=torch.save, args=(cpu, os.path.join(path, "ckpt.pt")))
        self.thread.start()
        return time.perf_counter() - t0

    def close(self) -> None:
        self._drain()


def loop(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    steps: int,
    every: int,
    saver: Saver | None,
    sync: Callable[[], None],
) -> dict[str, Any]:
    """Train ``steps`` steps, saving every ``every``; per-step times and per-save stalls."""
    step_s: list[float] = []
    stalls: list[float] = []
    save_cpu: list[float] = []
    hook0 = getattr(saver, "hook_s", 0.0)
    p0, c0 = time.process_time(), time.thread_time()
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        waited = saver.before_step() if saver else 0.0
        opt.step()
        if saver is not None and i % every == 0:
            hook = getattr(saver, "hook_s", 0.0)
            if stalls:  # hook waits since the previous save belong to it
                stalls[-1] += hook - hook0
            hook0 = hook
            t_cpu = time.thread_time()
            stalls.append(saver.save(i))
            save_cpu.append(time.thread_time() - t_cpu)
        elif stalls:
            stalls[-1] += waited
        sync()
        step_s.append(time.perf_counter() - t0)
    if saver is not None and stalls:
        stalls[-1] += getattr(saver, "hook_s", 0.0) - hook0
    own = time.thread_time() - c0
    return {
        "step_s": step_s,
        "stalls": stalls,
        "save_cpu": save_cpu,
        "background_cpu_per_step": (time.process_time() - p0 - own) / steps,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--state-mib", type=int, default=256, help="params + Adam state (MiB); the issue asks 1024"
    )
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64, help="rows per step (sets the forward/backward time)")
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--saves", type=int, default=3, help="saves per saver at --every")
    p.add_argument("--every-step", type=int, default=6, help="steps of the save-every-step run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--savers", default="ckpt lazy,ckpt eager,dcp async_save,dcp DefaultStager,nxd-style")
    p.add_argument("--out", default=os.path.join(HERE, "results", "stall.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    cuda = args.device.startswith("cuda")
    if not dist.is_initialized():  # DCP's async_save wants a process group; one gloo rank
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, opt = build(args.state_mib, args.width, args.device)
    x = torch.randn(args.batch, args.width, device=args.device)
    loop(model, opt, x, 2, 10**9, None, sync)  # Adam state exists, kernels warm
    nbytes = state_bytes(model, opt)
    gib = nbytes / 2**30
    work = args.dir or tempfile.mkdtemp(prefix="ckpt-stall-")
    results: dict[str, Any] = {
        "state_bytes": nbytes,
        "device": args.device,
        "torch": torch.__version__,
        "args": vars(args),
    }
    if cuda:
        src = torch.empty(nbytes // 4, device=args.device)
        dst = torch.empty(nbytes // 4, pin_memory=True)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        results["d2h_pinned_gbps"] = nbytes / (time.perf_counter() - t0) / 1e9
        del src, dst
    base = loop(model, opt, x, args.every * args.saves, 10**9, None, sync)["step_s"]
    rows: dict[str, Any] = {}
    names = [s.strip() for s in args.savers.split(",") if s.strip()]
    for name in names:
        root = os.path.join(work, name.replace(" ", "_"))
        os.makedirs(root, exist_ok=True)

        def make(name: str = name, root: str = root) -> Saver:
            if name.startswith("ckpt"):
                return CkptSaver(root, model, opt, lazy=name == "ckpt lazy")
            if name.startswith("dcp"):
                return DcpSaver(root, model, opt, stager="DefaultStager" in name, cuda=cuda)
            return NxdStyleSaver(root, model, opt)

        s = make()
        a = loop(model, opt, x, args.every * args.saves + 1, args.every, s, sync)
        s.close()
        s = make(root=root + "_1")
        os.makedirs(root + "_1", exist_ok=True)
        b = loop(model, opt, x, args.every_step, 1, s, sync)
        s.close()
        stall = statistics.median(a["stalls"])
        rows[name] = {
            "stall_s": stall,
            "stall_ms_per_gib": stall * 1e3 / gib,
            "stalls_s": a["stalls"],
            "step_s_every_step": statistics.mean(b["step_s"][1:]),
            "stall_s_every_step": statistics.median(b["stalls"][1:]),
            "save_cpu_s": statistics.median(a["save_cpu"]),
            "background_cpu_s_per_step_every_step": b["background_cpu_per_step"],
            "lazy_bytes": getattr(s, "lazy_bytes", None),
        }
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(root + "_1", ignore_errors=True)
        print(f"{name}: stall {stall * 1e3:.1f} ms", flush=True)
    base += loop(model, opt, x, args.every * args.saves, 10**9, None, sync)["step_s"]
    step = statistics.mean(base)
    results["step_s_no_checkpoint"] = step
    results["step_s_no_checkpoint_runs"] = [
        statistics.mean(base[: len(base) // 2]),
        statistics.mean(base[len(base) // 2 :]),
    ]
    ref = rows.get("dcp async_save", {}).get("stall_s")
    for r in rows.values():
        r["overhead_every_step"] = r["step_s_every_step"] / step - 1
        r["stall_vs_dcp"] = r["stall_s"] / ref if ref else None
    results["savers"] = rows
    lazy = rows.get("ckpt lazy")
    if lazy:
        results["goals"] = {
            "stall <= 0.1x DCP async_save": lazy["stall_vs_dcp"] is not None and lazy["stall_vs_dcp"] <= 0.1,
            "stall <= 10 ms/GiB": lazy["stall_ms_per_gib"] <= 10,
            "overhead at a save every step <= 10%": lazy["overhead_every_step"] <= 0.10,
        }
    print(f"state {nbytes / 2**20:.0f} MiB on {args.device}; step without checkpoints {step * 1e3:.0f} ms")
    print(
        f"{'saver':20} {'stall/save ms':>14} {'ms/GiB':>8} {'vs DCP':>7} {'CPU in save ms':>15} "
        f"{'every-step ovh':>15} {'bg CPU/step s':>14}"
    )
    for name, r in rows.items():
        vs = f"{r['stall_vs_dcp']:.3f}" if r["stall_vs_dcp"] is not None else "-"
        print(
            f"{name:20} {r['stall_s'] * 1e3:14.1f} {r['stall_ms_per_gib']:8.1f} {vs:>7} "
            f"{r['save_cpu_s'] * 1e3:15.1f} {r['overhead_every_step'] * 100:14.1f}% "
            f"{r['background_cpu_s_per_step_every_step']:14.3f}"
        )
    if "goals" in results:
        print(json.dumps(results["goals"]))
    finish(results, args.out, work, keep=bool(args.dir))
    return 0


def finish(results: dict[str, Any], out: str, work: str, keep: bool) -> None:
    """Write ``results`` to ``out`` (JSON), remove the scratch folder unless ``keep``, leave the process group."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
