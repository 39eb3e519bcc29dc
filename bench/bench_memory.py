"""Peak memory and wall time of ``ckpt convert`` for every source -> target format, at several model sizes.

For each size a Llama-shaped fp32 model with AdamW moments is generated (our format, CUDA layout) and converted,
unmeasured, into every source format (ckpt, HF, DCP, NxD plain TP 2 PP 2 ZeRO-1 DP 2, NxD xser); then each source is
converted into every target format (ckpt, HF, DCP, NxD plain and xser at TP 4 PP 2 DP 2), one child process per
conversion, with the defaults a user gets (64 MiB writer batches, checksums and NxD CRCs verified on read, glibc's
own malloc settings).  This process polls the child's ``/proc/<pid>/status`` every millisecond
(``tests/torture/memory.py``) for:

* peak anon: the peak ``RssAnon`` growth above the child's own memory right before the conversion (interpreter and
  torch, ~0.27 GiB, not included): what the conversion allocates;
* peak RSS: the same for ``VmRSS``, which also counts the memory-mapped source pages it touched (page cache the
  kernel reclaims under pressure);
* wall: the conversion's own time, and ``vs copy`` = time to copy the source's files byte for byte
  (``shutil.copyfile``, same disk) / conversion time.

Usage: ``python bench/bench_memory.py [--layers 6,28] [--workdir DIR] [--json bench/results/memory.json]``.
Everything generated is deleted at the end (each output as soon as it is measured).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from torture import memory  # noqa: E402
from torture.memory import MIB, SOURCES, TARGETS, generate_cuda, make_sources, measure  # noqa: E402

GIB = 1 << 30
#: a target rank is 1/8 of the model (NxD's file unit, which the NxD writer builds whole)
TARGET_NXD = {"tp": 4, "pp": 2, "dp": 2}
DIMS = {
    "hidden_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 2816,
    "vocab_size": 16000,
}


def _copy_time(src: Path, dst: Path) -> float:
    """Seconds to copy every file under ``src`` (the same bytes a conversion reads and writes) and fsync them."""
    t0 = time.perf_counter()
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    for f in files:
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, out)
        with open(out, "rb+") as fh:
            os.fsync(fh.fileno())
    took = time.perf_counter() - t0
    shutil.rmtree(dst, ignore_errors=True)
    return took


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_size(work: Path, layers: int) -> dict:
    cfg = memory.config(layers, **DIMS)
    root = work / f"l{layers}"
    root.mkdir(parents=True)
    total = generate_cuda(root / "base", cfg)
    print(f"# {layers} layers: {total / GIB:.2f} GiB of tensors", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        srcs = make_sources(root, root / "base", cfg)
    rows = []
    for s in SOURCES:
        copy = _copy_time(srcs[s], root / "rawcopy")
        for t in TARGETS:
            dst = root / f"out_{s}_{t}" / ("step_3" if t.startswith("nxd") else "")
            (peak,) = measure(
                [{"src": srcs[s], "dst": dst, "target": t, "config": cfg, "src_name": s, "nxd": TARGET_NXD}],
                exact_malloc=False,
                timeout=3600,
            )
            row = {
                "layers": layers, "model_bytes": total if s != "hf" else total // 3, "source": s, "target": t,
                "peak_anon": peak.anon, "peak_rss": peak.rss, "base_anon": peak.base_anon,
                "estimate": peak.estimate, "wall": peak.wall, "copy": copy, "src_bytes": _bytes(srcs[s]),
            }  # fmt: skip
            rows.append(row)
            print(
                f"{s:>8} -> {t:<8} anon {peak.anon / MIB:7.1f} MiB  rss {peak.rss / MIB:7.1f} MiB  "
                f"est {peak.estimate / MIB:7.1f} MiB  wall {peak.wall:6.1f} s  copy {copy:5.1f} s  "
                f"vs copy {copy / peak.wall:4.2f}x",
                flush=True,
            )
            shutil.rmtree(root / f"out_{s}_{t}", ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return {"layers": layers, "bytes": total, "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="6,28", help="model sizes, as numbers of decoder layers")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=str(HERE / "results" / "memory.json"))
    args = p.parse_args()
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    work = Path(tempfile.mkdtemp(prefix="ckpt-mem-", dir=args.workdir))
    try:
        sizes = [run_size(work, int(n)) for n in args.layers.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(sizes, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
