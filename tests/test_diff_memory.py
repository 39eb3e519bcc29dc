"""``ckpt diff`` streams: comparing two checkpoints of a model holds a few tensors, never either model.

The generated Llama-shaped fp32 model with AdamW moments of tests/test_convert_memory.py (``tests/torture/memory.py``;
~180 MiB, no tensor over 6.3 MiB) is converted (unmeasured) to an HF folder and an NxD tag (TP 2, PP 2, ZeRO-1 over
DP 2, plain rank files); a child process then diffs pairs of them while this process polls its ``RssAnon``.
Asserted for each pair: the two compare equal, and the peak ``RssAnon`` growth stays under a quarter of the bytes
compared (what a diff that loaded one side would need at least) and under 8 x the largest tensor + 16 MiB
(one tensor pair, its float64 comparison slices, the allocator's slack).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from torture.memory import MIB, config, generate_cuda, make_sources, measure

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")

LAYERS = 8
PAIRS = (("ckpt", "hf"), ("ckpt", "nxd"), ("nxd", "hf"))


def test_diff_peak_memory_is_a_few_tensors_not_the_model(tmp_path: Path) -> None:
    from ckpt.layouts import ModelDims

    cfg = config(LAYERS)
    total = generate_cuda(tmp_path / "base", cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        srcs = make_sources(tmp_path, tmp_path / "base", cfg, which=("ckpt", "hf", "nxd"))
    shapes = ModelDims.from_hf_config(cfg).hf_shapes()
    largest = max(4 * s[0] * (s[1] if len(s) > 1 else 1) for s in shapes.values())
    jobs = [
        {"diff": [str(srcs[a]), str(srcs[b])], "src": str(srcs[a]), "config": cfg, "src_name": a, "target": b}
        for a, b in PAIRS
    ]
    peaks = measure(jobs)
    rows = []
    for p in peaks:
        compared = total // 3 if "hf" in (p.src, p.target) else total  # an HF folder holds no optimizer
        rows.append((p, compared))
    table = "\n".join(
        f"{p.src:>5} vs {p.target:<5} anon {p.anon / MIB:6.1f} MiB  compared {c / MIB:6.1f} MiB  "
        f"largest tensor {largest / MIB:4.1f} MiB  wall {p.wall:5.2f} s"
        for p, c in rows
    )
    print(table)
    assert [(p.src, p.target) for p in peaks] == list(PAIRS)
    over = [p for p, c in rows if p.anon >= c / 4 or p.anon >= 8 * largest + 16 * MIB]
    assert not over, "over the bound:\n" + table
