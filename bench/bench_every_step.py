"""A save at every step into the host-memory tier, and restarts from it (issue 38).

    .venv/bin/python bench/bench_every_step.py restart [--gib 0.25]   # SIGKILL, then restore: memory vs disk vs S3
    .venv/bin/python bench/bench_every_step.py lora                   # LoRA adapter + its AdamW state, every step
    .venv/bin/python bench/bench_every_step.py xla                    # torch-xla (PJRT CPU), every step
    .venv/bin/python bench/bench_every_step.py held                   # the training thread's time held per save

The per-step cost of the memory tier beside DCP and ckpt's own async save at 0.25 and 0.75 GiB, every step and every
10 steps, is ``bench/bench_inloop.py --savers none,mem,ckpt,dcp --sizes 0.25,0.75 --every 1,10`` (its ``mem`` row).

``restart``: a trainer process (``bench_stall.build``: fp32 Linear stack + Adam, ``--gib`` of state) saves one step
to ``CheckpointManager(root, local_dir=<in /dev/shm>, local_memory=True, persist_every=1)``, waits until the
persistent copy is committed, and is SIGKILLed.  A fresh process then times ``restore_latest`` (the call alone; the
interpreter and torch start-up are the same in every case) and checks the restored state bit for bit against the
saved one's digest, three ways in one run:

* memory: the run's folder in /dev/shm is still there (a trainer restarted on the same node);
* disk: the memory is gone (rmtree) and the root's pages are evicted from the page cache with
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file (clean pages, after the save's fsync: they go).  Dropping the
  whole page cache (``/proc/sys/vm/drop_caches``) is refused in this container and would hit the other jobs of this
  shared machine; the per-file eviction is what a cold restart reads;
* s3: the same with the root on a moto S3 server on 127.0.0.1 (no network; a real S3 is slower).

``lora`` / ``xla``: one training loop, interleaved rounds of no saves and of a save into the memory tier at every
step; cost = median step time with saves / without - 1.  Writes ``bench/results/every_step_<what>.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

GIB = 2**30


def digest(model: Any, opt: Any) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    for p in model.parameters():
        for _, v in sorted(opt.state[p].items()):
            h.update(v.detach().cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def manager(root: str, shm: str, endpoint: str | None) -> Any:
    from ckpt.manager import CheckpointManager

    opts = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else None
    return CheckpointManager(root, local_dir=shm, local_memory=True, persist_every=1, storage_options=opts)


def child(args: argparse.Namespace) -> int:
    """One trainer process: ``--mode save`` saves step 1 and waits to be killed; ``--mode restore`` times it."""
    import torch
    from bench_stall import build

    torch.set_num_threads(1)
    mib = int(args.gib * 1024)
    model, opt = build(mib, 1024, "cpu")
    if args.mode == "save":
        x = torch.randn(8, 1024)
        for _ in range(2):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        mgr = manager(args.root, args.shm, args.endpoint)
        mgr.save(1, model=model, optimizer=opt, rng=False)
        mgr.wait()
        print(json.dumps({"digest": digest(model, opt)}), flush=True)
        time.sleep(3600)  # killed here (SIGKILL): no close, no cleanup
        return 0
    for p in model.parameters():  # a fresh trainer: Adam state exists (zeros), then is overwritten
        p.grad = torch.zeros_like(p)
    opt.step()
    mgr = manager(args.root, args.shm, args.endpoint)
    t0 = time.perf_counter()
    step = mgr.restore_latest(model=model, optimizer=opt)
    took = time.perf_counter() - t0
    tier = mgr.last_restore.tier if mgr.last_restore is not None else None
    print(
        json.dumps({"step": step, "tier": tier, "restore_s": took, "digest": digest(model, opt)}), flush=True
    )
    os._exit(0)  # as a crashed trainer would: no close (keeps the memory tier for the next case)


def spawn(args: argparse.Namespace, mode: str, root: str, shm: str, endpoint: str | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "_child", "--mode", mode, "--root", root, "--shm", shm,
           "--gib", str(args.gib)] + (["--endpoint", endpoint] if endpoint else [])  # fmt: skip
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if mode == "save":
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    if not line:
        raise SystemExit(f"bench_every_step: the {mode} process gave no result (exit {proc.returncode})")
    return json.loads(line)


def evict(folder: str) -> int:
    """Evict every file under ``folder`` from the page cache; returns the bytes asked to go."""
    n = 0
    for d, _, files in os.walk(folder):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                size = os.fstat(fd).st_size
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
                n += size
            finally:
                os.close(fd)
    return n


def restart(args: argparse.Namespace) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="ckpt-every-step-")
    out: dict[str, Any] = {"gib": args.gib, "load_before": os.getloadavg(), "rounds": []}
    try:
        for rnd in range(args.rounds):
            res: dict[str, Any] = {}
            shm = tempfile.mkdtemp(prefix="ckpt-bench-", dir="/dev/shm")
            root = os.path.join(work, f"disk{rnd}")
            saved = spawn(args, "save", root, shm, None)["digest"]
            res["memory"] = spawn(args, "restore", root, shm, None)
            shutil.rmtree(shm)
            res["evicted_bytes"] = evict(root)
            res["disk"] = spawn(args, "restore", root, shm, None)
            shutil.rmtree(shm, ignore_errors=True)
            if not args.no_s3:
                from torture.s3 import moto_server

                shm = tempfile.mkdtemp(prefix="ckpt-bench-", dir="/dev/shm")
                with moto_server(f"every{rnd}") as endpoint:
                    url = f"s3://every{rnd}/run"
                    saved_s3 = spawn(args, "save", url, shm, endpoint)["digest"]
                    shutil.rmtree(shm)
                    res["s3"] = spawn(args, "restore", url, shm, endpoint)
                    res["s3"]["bit_exact"] = res["s3"]["digest"] == saved_s3
                shutil.rmtree(shm, ignore_errors=True)
            for k in ("memory", "disk"):
                res[k]["bit_exact"] = res[k]["digest"] == saved
            out["rounds"].append(res)
            print(json.dumps({k: v for k, v in res.items() if isinstance(v, dict)}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {
        k: statistics.median(r[k]["restore_s"] for r in out["rounds"])
        for k in ("memory", "disk", "s3")
        if k in out["rounds"][0]
    }
    out["median_restore_s"] = med
    out["disk_over_memory"] = med["disk"] / med["memory"]
    if "s3" in med:
        out["s3_over_memory"] = med["s3"] / med["memory"]
    out["tiers"] = sorted({r[k]["tier"] for r in out["rounds"] for k in med})
    out["all_bit_exact"] = all(r[k]["bit_exact"] for r in out["rounds"] for k in med)
    out["load_after"] = os.getloadavg()
    return out


# ------------------------------------------------------------------------------------------------ loops


def loop(step: Any, save: Any, rounds: int, steps: int) -> dict[str, Any]:
    """Interleaved rounds: ``steps`` steps without saves, then ``steps`` with a save after each; median step s."""
    plain: list[float] = []
    saving: list[float] = []
    for _ in range(rounds):
        for with_save, into in ((False, plain), (True, saving)):
            for i in range(steps):
                t0 = time.perf_counter()
                step()
                if with_save:
                    save(i + 1)
                into.append(time.perf_counter() - t0)
    a, b = statistics.median(plain), statistics.median(saving)
    return {"step_s": a, "step_s_saving_every_step": b, "cost_pct": 100 * (b / a - 1)}


def lora(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from bench_lora import build

    from ckpt.manager import CheckpointManager

    torch.set_num_threads(1)
    model, opt = build(args.hidden, args.layers, 16, getattr(torch, args.base_dtype))
    ids = torch.randint(0, 32000, (1, 64))
    held: list[float] = []

    def step() -> None:
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    shm = tempfile.mkdtemp(prefix="ckpt-bench-", dir="/dev/shm")
    root = tempfile.mkdtemp(prefix="ckpt-lora-")
    try:
        mgr = CheckpointManager(root, local_dir=shm, local_memory=True, persist_every=10**9)

        def save(i: int) -> None:
            t0 = time.perf_counter()
            mgr.save(i, model=model, optimizer=opt, adapter_only=True, rng=False)
            held.append(time.perf_counter() - t0)

        step()
        save(1)
        save(2)  # warm: both arenas, the base's digest
        mgr.wait()
        held.clear()
        res = loop(step, save, args.rounds, args.steps)
        res["save_call_s"] = statistics.median(held)
        res["save_call_pct_of_step"] = 100 * res["save_call_s"] / res["step_s"]
        res["base_dtype"] = args.base_dtype
        mgr.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    res["adapter_and_state_mib"] = sum(p.numel() * 12 for p in model.parameters() if p.requires_grad) / 2**20
    res["base_mib"] = (
        sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad) / 2**20
    )
    return res


def xla(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch_xla.core.xla_model as xm

    from ckpt.manager import CheckpointManager

    dev = xm.xla_device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    x = torch.randn(8, 1024, device=dev)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        xm.mark_step()
        xm.wait_device_ops()

    shm = tempfile.mkdtemp(prefix="ckpt-bench-", dir="/dev/shm")
    root = tempfile.mkdtemp(prefix="ckpt-xla-")
    try:
        for _ in range(3):
            step()
        mgr = CheckpointManager(root, local_dir=shm, local_memory=True, persist_every=10**9)

        def save(i: int) -> None:
            mgr.save(i, model=model, optimizer=opt, rng=False)

        save(1)
        save(2)
        mgr.wait()
        res = loop(step, save, args.rounds, args.steps)
        mgr.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    res["state_mib"] = sum(p.numel() * 12 for p in model.parameters()) / 2**20
    return res


def held(args: argparse.Namespace) -> dict[str, Any]:
    """The training thread's time held by each saver per save (inside ``save``, waiting before ``optimizer.step()``
    and in the step hook of lazy staging), as % of the median step without saves measured in the same rounds:
    what a save costs the step when its background work has cores of its own (this shared VM has none to spare,
    so the wall-time rows of bench_inloop.py also carry the background's CPU)."""
    import torch
    import torch.distributed as dist
    from bench_inloop import make, width_for
    from bench_stall import build, state_bytes

    torch.set_num_threads(1)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    work = tempfile.mkdtemp(prefix="ckpt-held-")
    out: dict[str, Any] = {"load_before": os.getloadavg(), "sizes": {}}
    try:
        for gib in args.sizes:
            w = width_for(gib)
            model, opt = build(int(gib * 1024), w, "cpu")
            x = torch.randn(8, w)
            names = ["mem", "ckpt", "dcp"]
            runs = {n: make(n, os.path.join(work, n), model, opt, False) for n in names}
            plain: list[float] = []
            per: dict[str, list[float]] = {n: [] for n in names}
            for rnd in range(args.rounds + 1):  # round 0 warms (arenas, writer, DCP planning): not counted
                for n in ["none", *names]:
                    r = runs.get(n)
                    for i in range(1, args.steps + 1):
                        ck = getattr(getattr(r, "mgr", None), "checkpointer", None) or getattr(r, "ck", None)
                        hook0 = ck.hook_wait_s if ck is not None else 0.0
                        t0 = time.perf_counter()
                        opt.zero_grad(set_to_none=True)
                        model(x).square().mean().backward()
                        t1 = time.perf_counter()
                        if r is not None:
                            r.before_step()
                        t2 = time.perf_counter()
                        opt.step()
                        t3 = time.perf_counter()
                        if r is not None:
                            r.save(i)
                        t4 = time.perf_counter()
                        hook = (ck.hook_wait_s - hook0) if ck is not None else 0.0
                        if rnd and r is None:
                            plain.append(t4 - t0)
                        elif rnd:
                            per[n].append((t2 - t1) + hook + (t4 - t3))
                    if r is not None:
                        r.cleanup()
            step = statistics.median(plain)
            res = {"state_gib": state_bytes(model, opt) / GIB, "step_s": step}
            for n in names:
                every1 = statistics.median(per[n])
                res[n] = {"held_per_save_s": every1, "every_step_pct": 100 * every1 / step,
                          "every_10_pct": 100 * every1 / (10 * step)}  # fmt: skip
                runs[n].close()
            out["sizes"][str(gib)] = res
            print(json.dumps({gib: res}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("restart", "lora", "xla", "held", "_child"))
    p.add_argument("--sizes", default="0.25,0.75", help="held: GiB of params + Adam state")
    p.add_argument("--gib", type=float, default=0.25)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="lora / xla: steps per round and per mode")
    p.add_argument("--hidden", type=int, default=1024, help="lora: the Llama base's hidden size")
    p.add_argument("--layers", type=int, default=4, help="lora: the Llama base's layers")
    p.add_argument(
        "--base-dtype",
        default="float32",
        help="lora: the frozen base's dtype (bfloat16 matmuls on a CPU without AVX-512 BF16 take seconds a step, "
        "which would make any save look free)",
    )
    p.add_argument("--no-s3", action="store_true", help="restart: skip the moto S3 case")
    p.add_argument("--mode", choices=("save", "restore"))
    p.add_argument("--root")
    p.add_argument("--shm")
    p.add_argument("--endpoint")
    p.add_argument("--out")
    args = p.parse_args()
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    if args.what == "_child":
        return child(args)
    t0 = time.time()
    load = os.getloadavg()
    args.sizes = [float(v) for v in args.sizes.split(",")]
    res = {"restart": restart, "lora": lora, "xla": xla, "held": held}[args.what](args)
    res.setdefault("load_before", load)
    res.setdefault("load_after", os.getloadavg())
    res["wall_s"] = time.time() - t0
    print(json.dumps({k: v for k, v in res.items() if k != "rounds"}, indent=1))
    out = args.out or os.path.join(HERE, "results", f"every_step_{args.what}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
