"""Peak memory and wall time of ``ckpt convert`` for every source -> target format, at several model sizes.

For each size a Llama-shaped fp32 model with AdamW moments is generated (our format, CUDA layout) and converted,
unmeasured, into every source format (ckpt, HF, DCP, NxD plain TP 2 PP 2 ZeRO-1 DP 2, NxD xser); then each source is
converted into every target format (ckpt, HF, DCP, NxD plain and xser at TP 4 PP 2 DP 2), one child process per
conversion, with the defaults a user gets (64 MiB writer batches, checksums and NxD CRCs verified on read, glibc's
malloc pinned as the CLI pins it, converters/engine/allocator.py).  This process polls the child's ``/proc/<pid>/status`` every millisecond
(``tests/torture/memory.py``) for:

* peak anon: the peak ``RssAnon`` growth above the child's own memory right before the conversion (interpreter and
  torch, ~0.27 GiB, not included): what the conversion allocates;
* peak RSS: the same for ``VmRSS``, which also counts the memory-mapped source pages it touched (page cache the
  kernel reclaims under pressure);
* wall: the conversion's own time, and ``vs copy`` = time to copy the source's files byte for byte
  (``shutil.copyfile``, same disk) / conversion time.

Usage: ``python bench/bench_memory.py [--layers 6,52] [--pairs all|SRC:DST,...] [--workdir DIR]
[--json bench/results/memory.json]``; the model for the run bigger than memory:
``--layers 195 --pairs ckpt:nxd,nxd:hf --reuse-nxd --copy-limit-gib 4`` (26 GiB; ~2x that on disk at the peak).
Disk stays bounded: the generated model, one other source format and one output at a time (each output deleted as
soon as it is measured, each source once its targets are).  Rows are written to the JSON as they are measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from torture import memory  # noqa: E402
from torture.memory import MIB, SOURCE_NXD, SOURCES, TARGETS, generate_cuda, make_sources, measure  # noqa: E402

GIB = 1 << 30
#: a target rank is 1/8 of the model (NxD's file unit, which the NxD writer builds whole)
TARGET_NXD = {"tp": 4, "pp": 2, "dp": 2}
#: the order sources are measured in: DCP (the last reader made to stream) and NxD (the headline) first, so that a run
#: stopped early has measured them
ORDER = ("dcp", "nxd", "ckpt", "hf", "nxd_xser")
DIMS = {
    "hidden_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 2816,
    "vocab_size": 16000,
}


def _copy_time(src: Path, dst: Path, limit: int | None = None) -> float:
    """Seconds to copy every file under ``src`` (the same bytes a conversion reads and writes) and fsync them.

    With ``limit``, only the first files up to ``limit`` bytes are copied and the time is scaled to all of the
    source's bytes (a whole copy of a model bigger than the free disk would not fit next to it)."""
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    total = sum(f.stat().st_size for f in files)
    done = 0
    t0 = time.perf_counter()
    for f in files:
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, out)
        with open(out, "rb+") as fh:
            os.fsync(fh.fileno())
        done += f.stat().st_size
        if limit is not None and done >= limit:
            break
    took = time.perf_counter() - t0
    shutil.rmtree(dst, ignore_errors=True)
    return took * total / max(done, 1)


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _free(path: Path) -> str:
    return f"{shutil.disk_usage(path).free / GIB:.1f} GiB free"


def run_size(
    work: Path,
    layers: int,
    pairs: list[tuple[str, str]],
    record: Callable[[dict], None],
    *,
    copy_limit: int | None = None,
    reuse_nxd: bool = False,
    cli_malloc: bool = True,
) -> None:
    """Measure ``pairs`` on a model of ``layers`` decoder layers, calling ``record`` with each row as it is measured.

    Disk is bounded: the generated model (our format, also the ckpt source) plus ONE other source format plus one
    output at a time; each source is made when its turn comes and deleted once its targets are measured, and the
    generated model as soon as no later source needs it.  ``reuse_nxd``: the measured ckpt -> nxd output becomes the
    NxD source (its layout is then the NxD targets' TP 4 PP 2 DP 2) instead of a second conversion of the model."""
    cfg = memory.config(layers, **DIMS)
    root = work / f"l{layers}"
    root.mkdir(parents=True)
    base = root / "base"
    total = generate_cuda(base, cfg)
    print(f"# {layers} layers: {total / GIB:.2f} GiB of tensors ({_free(root)})", flush=True)
    order = [s for s in ORDER if any(ps == s for ps, _ in pairs)]
    made: dict[str, Path] = {}
    for i, s in enumerate(order):
        if s in made:
            src = made[s]
        elif s == "ckpt":
            src = base
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                src = make_sources(root, base, cfg, (s,))[s]
        if s != "ckpt" and not any(later == "ckpt" or later not in made for later in order[i + 1 :]):
            shutil.rmtree(base, ignore_errors=True)  # no later source is made from it
        print(f"# source {s}: {_bytes(src) / GIB:.2f} GiB ({_free(root)})", flush=True)
        copy = _copy_time(src, root / "rawcopy", copy_limit)
        for t in [t for ps, t in pairs if ps == s]:
            out = root / f"out_{s}_{t}"
            dst = out / ("step_3" if t.startswith("nxd") else "")
            (peak,) = measure(
                [{"src": src, "dst": dst, "target": t, "config": cfg, "src_name": s, "nxd": TARGET_NXD}],
                exact_malloc=False,
                cli_malloc=cli_malloc,
                timeout=6 * 3600,
            )
            row = {
                "layers": layers, "model_bytes": total if s != "hf" else total // 3, "source": s, "target": t,
                "peak_anon": peak.anon, "peak_rss": peak.rss, "base_anon": peak.base_anon,
                "estimate": peak.estimate, "wall": peak.wall, "copy": copy, "src_bytes": _bytes(src),
                "copy_scaled": copy_limit is not None, "malloc": "cli" if cli_malloc else "glibc default", "nxd_source": (TARGET_NXD if s in made else SOURCE_NXD) if s.startswith("nxd") else None,
            }  # fmt: skip
            record(row)
            print(
                f"{s:>8} -> {t:<8} anon {peak.anon / MIB:7.1f} MiB  rss {peak.rss / MIB:7.1f} MiB  "
                f"est {peak.estimate / MIB:7.1f} MiB  wall {peak.wall:6.1f} s  copy {copy:5.1f} s  "
                f"vs copy {copy / peak.wall:4.2f}x  ({_free(root)})",
                flush=True,
            )
            if reuse_nxd and s == "ckpt" and t == "nxd" and "nxd" in order[i + 1 :]:
                made["nxd"] = out.rename(root / "src_nxd") / "step_3"
            else:
                shutil.rmtree(out, ignore_errors=True)
        if s != "ckpt":
            shutil.rmtree(src.parent if s.startswith("nxd") else src, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)


def _pairs(spec: str) -> list[tuple[str, str]]:
    if spec == "all":
        return [(s, t) for s in SOURCES for t in TARGETS]
    out = []
    for item in spec.split(","):
        s, _, t = item.partition(":")
        if s not in SOURCES or t not in TARGETS:
            raise SystemExit(f"bench_memory: error: --pairs {item!r}: expected SOURCE:TARGET of {SOURCES}")
        out.append((s, t))
    return out


def table(paths: list[str]) -> str:
    """The markdown table of docs/performance.md "Memory" from result files (one column group per model size; a
    later file's row of the same size and pair replaces an earlier one: reruns)."""
    merged: dict[int, dict] = {}
    for path in paths:
        for size in json.loads(Path(path).read_text()):
            into = merged.setdefault(size["layers"], {"bytes": size["bytes"], "rows": {}})
            into["rows"].update({(r["source"], r["target"]): r for r in size["rows"]})
    sizes = list(merged.values())
    cells: dict[tuple[str, str], list[str]] = {(s, t): [] for s in SOURCES for t in TARGETS}
    for size in sizes:
        rows = size["rows"]
        for key, out in cells.items():
            r = rows.get(key)
            if r is None:
                out += ["not measured", "-"]
                continue
            mib = [round(r[k] / MIB) for k in ("peak_anon", "peak_rss", "estimate")]
            out += [
                f"{mib[0]} / {mib[1]} / {mib[2]} MiB",
                f"{r['wall']:.1f} s ({r['copy'] / r['wall']:.2f}x)",
            ]
    head = "| source -> target | " + " | ".join(
        f"{size['bytes'] / GIB:.2f} GiB: peak anon / peak RSS / est | wall (vs copy)" for size in sizes
    )
    lines = [head + " |", "|---" * (1 + 2 * len(sizes)) + "|"]
    lines += [f"| {s} -> {t} | " + " | ".join(v) + " |" for (s, t), v in cells.items()]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="6,52", help="model sizes, as numbers of decoder layers")
    p.add_argument("--pairs", default="all", help="'all' or SOURCE:TARGET,... (e.g. ckpt:nxd,nxd:hf)")
    p.add_argument("--workdir", default=None)
    p.add_argument(
        "--copy-limit-gib", type=float, default=None, help="time the raw copy on this many GiB, scaled"
    )
    p.add_argument(
        "--reuse-nxd", action="store_true", help="the measured ckpt -> nxd output is the NxD source"
    )
    p.add_argument(
        "--default-malloc", action="store_true", help="glibc's adaptive malloc, not the CLI's pinned one"
    )
    p.add_argument("--json", default=str(HERE / "results" / "memory.json"))
    p.add_argument(
        "--table", default=None, help="print the docs table of these result files (comma-separated)"
    )
    args = p.parse_args()
    if args.table:
        print(table(args.table.split(",")))
        return 0
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    pairs = _pairs(args.pairs)
    limit = int(args.copy_limit_gib * GIB) if args.copy_limit_gib else None
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    sizes: list[dict] = []

    def record(row: dict) -> None:  # written after every row: a stopped run keeps what it measured
        sizes[-1]["rows"].append(row)
        out.write_text(json.dumps(sizes, indent=1) + "\n")

    work = Path(tempfile.mkdtemp(prefix="ckpt-mem-", dir=args.workdir))
    try:
        for n in args.layers.split(","):
            bytes_ = 4 * 3 * _params(int(n))
            sizes.append({"layers": int(n), "bytes": bytes_, "rows": []})
            run_size(
                work,
                int(n),
                pairs,
                record,
                copy_limit=limit,
                reuse_nxd=args.reuse_nxd,
                cli_malloc=not args.default_malloc,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}")
    return 0


def _params(layers: int) -> int:
    from ckpt.layouts import ModelDims

    shapes = ModelDims.from_hf_config(memory.config(layers, **DIMS)).hf_shapes()
    return sum(math.prod(s) for s in shapes.values())


if __name__ == "__main__":
    raise SystemExit(main())
