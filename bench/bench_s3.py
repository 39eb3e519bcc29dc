"""S3 save/load through ckpt vs s3fs put/get of the same bytes, against a moto server on 127.0.0.1.

    .venv/bin/python bench/bench_s3.py [--mib 256] [--repeat 3]

One process holds a --mib MiB state (fp32 tensors of LLM-like sizes). Measured in the same run, medians of
--repeat: ckpt save (sync) and restore of that state to s3://; s3fs ``put_file`` of one local file with the same
bytes and ``cat_file`` of it back (the floor ckpt's one-upload-per-rank design competes with). moto is an in-process
Python server on loopback, so absolute figures say little about real S3; the ratio to s3fs is the point.
Writes bench/results/s3.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from torture.s3 import moto_server  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    import fsspec
    import torch

    import ckpt

    g = torch.Generator().manual_seed(0)
    rows = max(1, args.mib * (1 << 20) // (4 * 4096 * 8))
    state = {f"layers.{i}.weight": torch.randn(rows, 4096, generator=g) for i in range(8)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    res: dict[str, list[float]] = {}
    with moto_server("ckpt-bench") as endpoint, tempfile.TemporaryDirectory() as d:
        options = {"client_kwargs": {"endpoint_url": endpoint}}
        fs = fsspec.filesystem("s3", **options)
        raw = os.path.join(d, "raw.bin")
        with open(raw, "wb") as f:
            for t in state.values():
                f.write(t.view(-1).view(torch.uint8).numpy().tobytes())
        for rep in range(args.repeat):
            url = f"s3://ckpt-bench/run/step_{rep:08d}"
            t0 = time.perf_counter()
            ckpt.save(url, step=rep, model=state, rng=False, storage_options=options)
            res.setdefault("ckpt save", []).append(time.perf_counter() - t0)
            back = {k: torch.empty_like(v) for k, v in state.items()}
            t0 = time.perf_counter()
            ckpt.restore(url, model=back, rng=False, storage_options=options)
            res.setdefault("ckpt load", []).append(time.perf_counter() - t0)
            assert all(torch.equal(back[k], v) for k, v in state.items())
            t0 = time.perf_counter()
            fs.put_file(raw, f"ckpt-bench/raw/{rep}.bin")
            res.setdefault("s3fs put_file", []).append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            data = fs.cat_file(f"ckpt-bench/raw/{rep}.bin")
            res.setdefault("s3fs get", []).append(time.perf_counter() - t0)
            assert len(data) == nbytes
            del data, back
    med = {k: statistics.median(v) for k, v in res.items()}
    mib = nbytes / (1 << 20)
    out = {
        "args": vars(args),
        "bytes": nbytes,
        "seconds": med,
        "MiB_per_s": {k: mib / v for k, v in med.items()},
        "save_vs_put": med["s3fs put_file"] / med["ckpt save"],
        "load_vs_get": med["s3fs get"] / med["ckpt load"],
    }
    print(json.dumps(out, indent=2))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "s3.json"), "w") as f:
        json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
