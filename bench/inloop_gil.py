"""How long a save's background threads hold the GIL: run under py-spy, which samples only GIL holders.

    py-spy record -r 500 --gil --threads -f raw -o /tmp/gil.txt -- .venv/bin/python bench/inloop_gil.py ckpt
    .venv/bin/python bench/inloop_gil.py --count /tmp/gil.txt

Modes: ``ckpt`` (writer thread), ``ckpt-process`` (writer process), ``dcp`` (``async_save``).  One 256 MiB model
(params + Adam), one warm save, then 5 saves, each waited for, with the training thread idle in ``wait()``
(waiting releases the GIL): every sample of another thread is time the save's background held the GIL, which a
training thread would have waited for.  ``--count`` prints samples per thread (x 2 ms at 500 Hz) and the top
frames of the background threads, counting only samples taken after the warm save (the ``MARK`` frame).
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def count(path: str) -> None:
    threads: collections.Counter[str] = collections.Counter()
    frames: collections.Counter[str] = collections.Counter()
    for line in open(path):
        stack, n = line.rstrip().rsplit(" ", 1)
        parts = stack.split(";")
        name = parts[1].split(" (")[0] if parts[0].startswith("thread") and len(parts) > 1 else parts[0]
        threads[parts[0].split(")")[-1].strip(": ") or name] += int(n)
        if "MainThread" not in parts[0]:
            frames[";".join(p.split(" (")[0] for p in parts[-3:])] += int(n)
    for k, v in threads.most_common():
        print(f"{v:6d} samples  {k}")
    for k, v in frames.most_common(12):
        print(f"{v:6d}  {k[:150]}")


def run(mode: str) -> None:
    import torch
    import torch.distributed as dist
    from bench_stall import DcpSaver, build

    from ckpt.saving.checkpointer import Checkpointer
    from ckpt.saving.options import SaveOptions
    from ckpt.saving.process_writer import ProcessStager
    from ckpt.saving.staging import HostStager

    no_rng = SaveOptions(rng=False)

    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="ckpt-gil-")
    model, opt = build(256, 1024, "cpu")
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    if mode == "dcp":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        saver = DcpSaver(work, model, opt, stager=False, cuda=False)

        def save(i: int) -> None:
            saver.save(i)
            saver._drain()
    else:
        ck = Checkpointer(async_save=True, stager=ProcessStager() if mode == "ckpt-process" else HostStager())

        def save(i: int) -> None:
            ck.save(os.path.join(work, str(i)), step=i, model=model, optimizer=opt, options=no_rng)
            ck.staged()
            ck.wait()
            shutil.rmtree(os.path.join(work, str(i)), ignore_errors=True)

    save(0)
    time.sleep(0.5)
    t0 = time.perf_counter()
    for i in range(1, 6):
        save(i)
    print(f"{mode}: 5 saves in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1] == "--count":
        count(sys.argv[2])
    else:
        run(sys.argv[1])
