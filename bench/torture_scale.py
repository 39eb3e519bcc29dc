"""Scale measurements: list 1,000 checkpoints; save / verify / load a checkpoint of 100,000 tensors.

    .venv/bin/python bench/torture_scale.py [--checkpoints 1000] [--tensors 100000]

Prints the figures and writes bench/results/scale.json (the target for listing is < 1 s). Correctness at the same
scale is checked by tests/test_torture_scale.py.
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

import torch  # noqa: E402
from torture.scale import many_checkpoints, many_tensors  # noqa: E402

import ckpt  # noqa: E402
from ckpt.format.integrity import verify_checkpoint  # noqa: E402
from ckpt.restoring.discovery import list_checkpoints  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", type=int, default=1000)
    p.add_argument("--tensors", type=int, default=100_000)
    args = p.parse_args()
    res: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="ckpt-scale-") as d:
        root = os.path.join(d, "run")
        many_checkpoints(root, args.checkpoints)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            infos = list_checkpoints(root)
            times.append(time.perf_counter() - t0)
        assert len(infos) == args.checkpoints
        res["list_checkpoints_s"] = statistics.median(times)
        t0 = time.perf_counter()
        list_checkpoints(root, check_files=True)
        res["list_checkpoints_check_files_s"] = time.perf_counter() - t0
        state = many_tensors(args.tensors)
        path = os.path.join(d, "many")
        t0 = time.perf_counter()
        ckpt.save(path, step=1, model=state, rng=False)
        res["save_100k_tensors_s"] = time.perf_counter() - t0
        res["manifest_bytes"] = os.path.getsize(os.path.join(path, "manifest.json"))
        t0 = time.perf_counter()
        reader = ckpt.open_checkpoint(path)
        res["open_manifest_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert verify_checkpoint(reader) == []
        res["verify_100k_tensors_s"] = time.perf_counter() - t0
        back = {k: torch.empty_like(v) for k, v in state.items()}
        t0 = time.perf_counter()
        ckpt.restore(path, model=back, rng=False)
        res["load_100k_tensors_s"] = time.perf_counter() - t0
    out = {"args": vars(args), "results": res}
    print(json.dumps(out, indent=2))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "scale.json"), "w") as f:
        json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
