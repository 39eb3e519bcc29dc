"""Every benchmark in one command: a table on screen, JSON in bench/results/all.json.

    .venv/bin/python bench/run_all.py [--quick]

Runs, each in its own process and each next to its baselines measured in the same run:

* bench_save_load.py: async blocking time, sync save, load — ckpt vs DCP (save/async_save/load), torch.save/load,
  one memory copy, raw sequential write/read of the same bytes;
* bench_stall.py: training-thread stall per save and step-time overhead at a save every step — ckpt lazy/eager vs
  DCP async_save (plain and DefaultStager) and NxD-style copy-then-thread, one loop, one state;
* bench_reshard.py: saved by 2 ranks, loaded by 1, 2, 4 — ckpt vs DCP;
* bench_s3.py: save/load on S3 (moto on 127.0.0.1) vs s3fs put_file/get of the same bytes;
* bench_load_checksum.py: local load with checksums (hashed on a helper thread) vs a raw read of the same bytes;
* torture_scale.py: listing 1,000 checkpoints, 100,000-tensor save/verify/load;
* bench_convert.py (when present): conversion vs raw copy and "load everything, then save".

``--quick`` shrinks every size (for a smoke run). Sizes are modest by default because the reference machine has
2 shared cores; see docs/performance.md for what that means for the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def run(name: str, argv: list[str]) -> tuple[float, str, int]:
    print(f"== {name}: {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, os.path.join(HERE, name), *argv], capture_output=True, text=True)
    print(p.stdout[-3000:], end="", flush=True)
    if p.returncode:
        print(p.stderr[-3000:], file=sys.stderr)
    return time.perf_counter() - t0, p.stdout, p.returncode


def load(name: str) -> dict:
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def last_json(text: str) -> dict:
    """The last top-level JSON object printed by a script (bench_convert prints its results that way)."""
    start = text.rfind("\n{")
    try:
        return json.loads(text[start + 1 :] if start >= 0 else text)
    except ValueError:
        return {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    q = args.quick
    os.makedirs(RESULTS, exist_ok=True)
    status: dict[str, int] = {}
    plan = [
        (
            "bench_save_load.py",
            ["--gib", "0.25" if q else "1.0", "--ranks", "2", "--repeat", "1" if q else "3"],
        ),
        ("bench_reshard.py", ["--gib", "0.0625" if q else "0.5", "--repeat", "1" if q else "3"]),
        ("bench_stall.py", ["--state-mib", "64" if q else "256", "--saves", "2" if q else "3"]),
        ("bench_s3.py", ["--mib", "32" if q else "256", "--repeat", "1" if q else "3"]),
        ("bench_load_checksum.py", ["--gib", "0.125" if q else "0.5", "--repeat", "2" if q else "7"]),
        ("torture_scale.py", ["--tensors", "10000" if q else "100000"]),
    ]
    convert_out = ""
    for name, argv in plan:
        _, _, status[name] = run(name, argv)
    if os.path.exists(os.path.join(HERE, "bench_convert.py")):
        _, convert_out, status["bench_convert.py"] = run(
            "bench_convert.py",
            ["--layers", "4", "--small-layers", "2"] if not q else ["--layers", "2", "--small-layers", "1"],
        )
    sl, rs, s3, sc = load("save_load.json"), load("reshard.json"), load("s3.json"), load("scale.json")
    stall = load("stall.json")
    rows: list[tuple[str, str, str, str]] = []  # (measure, ckpt, baseline, ratio)
    if sl:
        r = sl["seconds"]
        rows += [
            (
                "async save blocking (s)",
                f"{r['ckpt async blocking']:.3f}",
                f"DCP async_save {r['dcp async_save blocking']:.3f}",
                f"{r['ckpt async blocking'] / r['dcp async_save blocking']:.2f}x",
            ),
            (
                "async blocking vs 1 memcpy",
                f"{r['ckpt async blocking']:.3f}",
                f"memcpy {r['memcpy']:.3f}",
                f"{r['ckpt async blocking'] / r['memcpy']:.2f}x",
            ),
            (
                "sync save (s)",
                f"{r['ckpt save']:.3f}",
                f"DCP {r['dcp save']:.3f}",
                f"{r['ckpt save'] / r['dcp save']:.2f}x",
            ),
            (
                "sync save vs raw write",
                f"{r['ckpt save']:.3f}",
                f"raw {r['raw write']:.3f}",
                f"{r['raw write'] / r['ckpt save']:.2f}x bw",
            ),
            ("torch.save (s)", "", f"{r['torch.save']:.3f}", ""),
            (
                "load (s)",
                f"{r['ckpt load']:.3f}",
                f"DCP {r['dcp load']:.3f}",
                f"{r['ckpt load'] / r['dcp load']:.2f}x",
            ),
            (
                "load vs raw read",
                f"{r['ckpt load']:.3f}",
                f"raw {r['raw read']:.3f}",
                f"{r['raw read'] / r['ckpt load']:.2f}x bw",
            ),
            ("torch.load (s)", "", f"{r['torch.load']:.3f}", ""),
        ]
    for t in rs.get("table", []):
        rows.append(
            (
                f"load saved@2 at {t['ranks']} ranks (s)",
                f"{t['ckpt_s']:.3f}",
                f"DCP {t['dcp_s']:.3f}",
                f"{t['ckpt_s'] / t['dcp_s']:.2f}x",
            )
        )
    for name, r in stall.get("savers", {}).items():
        if name == "dcp async_save":
            continue
        rows.append(
            (
                f"stall per save, {name} (ms)",
                f"{r['stall_s'] * 1e3:.1f}",
                f"DCP async_save {stall['savers']['dcp async_save']['stall_s'] * 1e3:.1f}",
                f"{r['stall_vs_dcp']:.3f}x",
            )
        )
    if s3:
        m = s3["seconds"]
        rows.append(
            (
                "S3 save (s)",
                f"{m['ckpt save']:.3f}",
                f"s3fs put {m['s3fs put_file']:.3f}",
                f"{m['ckpt save'] / m['s3fs put_file']:.2f}x",
            )
        )
        rows.append(
            (
                "S3 load (s)",
                f"{m['ckpt load']:.3f}",
                f"s3fs get {m['s3fs get']:.3f}",
                f"{m['ckpt load'] / m['s3fs get']:.2f}x",
            )
        )
    if sc:
        r = sc["results"]
        rows.append(("list 1,000 checkpoints (s)", f"{r['list_checkpoints_s']:.3f}", "target 1.0", ""))
        rows.append(
            (
                f"{sc['args']['tensors']:,} tensors save/verify/load (s)",
                f"{r['save_100k_tensors_s']:.1f}/{r['verify_100k_tensors_s']:.1f}/{r['load_100k_tensors_s']:.1f}",
                "",
                "",
            )
        )
    conv = last_json(convert_out)
    print()
    print(f"{'measure':38} {'ckpt':>14}  {'baseline':28} {'ratio':>10}")
    for m, a, b, c in rows:
        print(f"{m:38} {a:>14}  {b:28} {c:>10}")
    if conv:
        print(f"conversion: {json.dumps(conv)[:400]}")
    out = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "status": status,
        "rows": [dict(zip(("measure", "ckpt", "baseline", "ratio"), r, strict=True)) for r in rows],
        "save_load": sl,
        "reshard": rs,
        "stall": stall,
        "s3": s3,
        "scale": sc,
        "convert": conv,
    }
    with open(os.path.join(RESULTS, "all.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {os.path.join(RESULTS, 'all.json')}")
    return 1 if any(status.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
