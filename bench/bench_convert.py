"""Conversion throughput and peak memory on a generated checkpoint of >= 2 GiB.

Measures, in one run and on the same bytes:

* raw copy: ``shutil.copyfile`` of every data file of the source (the I/O floor a conversion competes with);
* ``ckpt convert`` cuda -> neuron (TP 8, GQA ``qkv_linear``, PP 2) in a child process: wall time and peak RSS
  (``ru_maxrss`` of that child), with 1 and 2 workers;
* the "load everything, then save" baseline: a child that reads every tensor, converts the whole state in memory
  with the layout engine, then writes it;
* peak RSS of the streaming conversion at two model sizes (to show it is flat in model size).

Usage: ``python bench/bench_convert.py [--workdir DIR] [--layers 10] [--small-layers 4] [--out docs/performance.md]``.
The generated checkpoints are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 1 << 30
CONFIG = {
    "model_type": "llama",
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 5632,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
FLAGS = {"tp": 8, "pp": 2, "qkv_linear": True, "kv_size_multiplier": 2}


def generate(path: Path, layers: int) -> int:
    """A CUDA-layout checkpoint (fp32 parameters) of a Llama-shaped model, written one tensor at a time."""
    import torch

    from ckpt.layouts import ModelDims
    from ckpt.saving.writer import StreamingWriter

    cfg = dict(CONFIG, num_hidden_layers=layers)
    shapes = ModelDims.from_hf_config(cfg).hf_shapes()
    g = torch.Generator().manual_seed(0)
    w = StreamingWriter(str(path), flush_bytes=256 << 20)
    for name, shape in shapes.items():
        w.add(name, torch.rand(shape, generator=g))
    w.commit(step=1, backend="cuda", trees={"extra": {"config": cfg}})
    return w.bytes_written


def _child(code: str) -> tuple[float, int]:
    """Run ``code`` in a fresh interpreter; return (wall seconds, peak RSS bytes of that child)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code])
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child failed: {code[:200]}")
    return wall, usage.ru_maxrss * 1024


def convert_child(src: Path, dst: Path, workers: int) -> tuple[float, int]:
    code = (
        "from ckpt.converters.convert import ConvertOptions, RunOptions, convert\n"
        f"convert({str(src)!r}, {str(dst)!r}, ConvertOptions.neuron(**{dict(FLAGS)!r}), RunOptions(workers={workers}))\n"
    )
    wall, rss = _child(code)
    if workers > 1:  # the workers are grandchildren: take the largest worker's peak
        rss = max(rss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    return wall, rss


def baseline_child(src: Path, dst: Path) -> tuple[float, int]:
    code = f"""
from ckpt import open_checkpoint
from ckpt.layouts import LayoutSpec, full_state_to_nxd
from ckpt.layouts.partition import nxd_partition
from ckpt.layouts.pipeline import pp_ranks_of
from ckpt.saving.writer import StreamingWriter
import torch
r = open_checkpoint({str(src)!r})
state = {{n: r.read(n) for n in r.names()}}          # load everything
spec = LayoutSpec.from_hf_config(r.manifest.extra["config"], **{FLAGS!r})
shards = full_state_to_nxd(state, spec)             # convert in memory
w = StreamingWriter({str(dst)!r}, flush_bytes=1 << 40)
done = set()
for (tp, pp), sd in sorted(shards.items()):
    for n, t in sd.items():
        if pp != pp_ranks_of(n, spec)[0]:
            continue
        dim = (nxd_partition(n) or (None,))[0]
        if dim is None:
            if n in done:
                continue
            done.add(n)
            w.add(n, t)
            continue
        shape = list(t.shape); shape[dim] *= spec.tp
        offs = [0] * t.dim(); offs[dim] = tp * t.shape[dim]
        from ckpt.format.manifest import Box
        w.add(n, t, shape=tuple(shape), box=Box(tuple(offs), tuple(t.shape)))
w.commit(step=1, backend="neuron")                 # then save
"""
    return _child(code)


def raw_copy(src: Path, dst: Path, kernel: bool = False) -> float:
    """Copy every file of ``src`` (+fsync): in user space (read/write, 64 MiB buffers: what any tool that looks at
    the bytes must do) or in the kernel (``shutil.copyfile`` -> ``copy_file_range``/``sendfile``, no user copy)."""
    dst.mkdir(parents=True)
    t0 = time.perf_counter()
    for f in sorted(src.iterdir()):
        if kernel:
            shutil.copyfile(f, dst / f.name)
        else:
            with open(f, "rb") as a, open(dst / f.name, "wb") as b:
                while buf := a.read(64 << 20):
                    b.write(buf)
        with open(dst / f.name, "rb") as fh:
            os.fsync(fh.fileno())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--small-layers", type=int, default=4)
    ap.add_argument("--out", default=None, help="append a 'Conversion' section to this markdown file")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir))
    try:
        src = work / "src"
        size = generate(src, args.layers)
        print(f"generated {size / GIB:.2f} GiB ({args.layers} layers)", flush=True)
        t_copy = raw_copy(src, work / "copy")
        shutil.rmtree(work / "copy")
        res = {"bytes": size, "layers": args.layers, "copy_s": t_copy}
        res["kernel_copy_s"] = raw_copy(src, work / "kcopy", kernel=True)
        shutil.rmtree(work / "kcopy")
        for workers in (1, 2):
            dst = work / f"conv{workers}"
            wall, rss = convert_child(src, dst, workers)
            res[f"convert_w{workers}_s"], res[f"convert_w{workers}_rss"] = wall, rss
            shutil.rmtree(dst)
            print(f"convert workers={workers}: {wall:.1f}s rss {rss / GIB:.2f} GiB", flush=True)
        # raw copy again, after the conversions, so that page-cache state is comparable
        t_copy2 = raw_copy(src, work / "copy")
        shutil.rmtree(work / "copy")
        res["copy_s"] = min(t_copy, t_copy2)
        wall, rss = baseline_child(src, work / "base")
        shutil.rmtree(work / "base")
        res["baseline_s"], res["baseline_rss"] = wall, rss
        print(f"baseline: {wall:.1f}s rss {rss / GIB:.2f} GiB", flush=True)
        shutil.rmtree(src)
        small = work / "small"
        res["small_bytes"] = generate(small, args.small_layers)
        wall, rss = convert_child(small, work / "small_out", 1)
        res["small_layers"], res["small_rss"], res["small_s"] = args.small_layers, rss, wall
        print(json.dumps(res, indent=1))
        if args.out:
            append_report(Path(args.out), res)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def append_report(path: Path, r: dict) -> None:
    gib = r["bytes"] / GIB
    copy_tp = r["bytes"] / r["copy_s"] / GIB

    def tp(s: float, b: int = r["bytes"]) -> float:
        return b / s / GIB

    lines = [
        "",
        "## Conversion",
        "",
        f"`bench/bench_convert.py` on this machine ({os.cpu_count()} CPUs, local disk), generated Llama-shaped fp32 "
        f"checkpoint of {gib:.2f} GiB ({r['layers']} layers, hidden 2048, GQA 16/4 heads), cuda -> neuron "
        "(`--tp 8 --pp 2 --qkv-linear --kv-size-multiplier 2`), our manifest format on both sides, checksums "
        "verified on read and computed on write. Peak RSS = `ru_maxrss` of the converting process.",
        "",
        "| run | time | throughput | vs raw copy | peak RSS |",
        "|---|---|---|---|---|",
        f"| raw copy of the data files, user space read/write (+fsync) | {r['copy_s']:.1f} s | {copy_tp:.2f} GiB/s "
        "| 1.00x | - |",
        f"| raw copy, in-kernel `copy_file_range` (+fsync) | {r['kernel_copy_s']:.1f} s | "
        f"{tp(r['kernel_copy_s']):.2f} GiB/s | {r['copy_s'] / r['kernel_copy_s']:.2f}x | - |",
        f"| `ckpt convert`, 1 worker | {r['convert_w1_s']:.1f} s | {tp(r['convert_w1_s']):.2f} GiB/s | "
        f"{r['copy_s'] / r['convert_w1_s']:.2f}x | {r['convert_w1_rss'] / GIB:.2f} GiB |",
        f"| `ckpt convert`, 2 workers | {r['convert_w2_s']:.1f} s | {tp(r['convert_w2_s']):.2f} GiB/s | "
        f"{r['copy_s'] / r['convert_w2_s']:.2f}x | {r['convert_w2_rss'] / GIB:.2f} GiB (largest process) |",
        f"| load everything, convert in memory, save | {r['baseline_s']:.1f} s | {tp(r['baseline_s']):.2f} GiB/s | "
        f"{r['copy_s'] / r['baseline_s']:.2f}x | {r['baseline_rss'] / GIB:.2f} GiB |",
        "",
        f"Peak RSS in model size (streaming, 1 worker): {r['small_bytes'] / GIB:.2f} GiB model "
        f"({r['small_layers']} layers) -> {r['small_rss'] / GIB:.2f} GiB; {gib:.2f} GiB model -> "
        f"{r['convert_w1_rss'] / GIB:.2f} GiB. Process baseline (python + torch imported) is included in both.",
        "",
    ]
    with open(path, "a") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
