"""Every source x target conversion streams: its peak anonymous memory stays under a third of the model, and the
dry-run's estimate is within 2x of it.

One generated Llama-shaped fp32 model with AdamW moments (``tests/torture/memory.py``; ~180 MiB, no tensor over
6.3 MiB) is converted (unmeasured) into every source format: our manifest, HF safetensors, DCP, an NxD tag with
plain rank files (TP 2, PP 2, ZeRO-1 over DP 2) and the same tag in xser form.  A child process then converts each
source into every target format (ckpt, HF, DCP, NxD plain and NxD xser at TP 2 PP 4 DP 2), while this process polls
its ``RssAnon`` (one child per source).  Asserted for each of the 25 pairs:

* peak ``RssAnon`` growth (above the child's own memory right before the conversion: interpreter, torch, imports)
  < model bytes / 3, where the model is the bytes converted (HF holds no optimizer);
* the ``--dry-run`` estimate and the measurement are within 2x of each other (plus 8 MiB for allocator noise);
* the outputs are exact: every target's files (NxD rank files, HF shards, DCP data) are the same bytes whatever the
  source, and our manifests list the same chunk checksums as the generated model's.

Our writer runs with 8 MiB batches here (the default 64 MiB would be most of this small model); the bench
(``bench/bench_memory.py``) measures the defaults on models of GiBs.  The child runs with glibc's dynamic mmap
threshold off so that ``RssAnon`` shows what the conversion holds rather than freed heap the allocator kept.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from manifest_io import manifest_dict
from torture.memory import MIB, SOURCES, TARGETS, Peak, config, generate_cuda, make_sources, measure

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")

LAYERS = 8
FLUSH = 8 * MIB
SLACK = 8 * MIB


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The generated model in every source format; conversions are measured per source on first use."""
    root = tmp_path_factory.mktemp("memory")
    cfg = config(LAYERS)
    total = generate_cuda(root / "base", cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        srcs = make_sources(root, root / "base", cfg)
    return {"root": root, "srcs": srcs, "total": total, "config": cfg, "peaks": {}}


def _measured(converted: dict, source: str) -> list[Peak]:
    """Peaks of ``source`` -> every target, measured in one child process (once per module)."""
    if source not in converted["peaks"]:
        jobs = [
            {
                "src": converted["srcs"][source],
                "dst": converted["root"] / f"out_{source}_{t}" / ("step_3" if t.startswith("nxd") else ""),
                "target": t,
                "config": converted["config"],
                "src_name": source,
                "flush_bytes": FLUSH,
            }  # fmt: skip
            for t in TARGETS
        ]
        converted["peaks"][source] = measure(jobs)
    return converted["peaks"][source]


def _model_bytes(source: str, converted: dict) -> int:
    """Bytes of what is converted: the whole state, or only the weights for HF (which holds no optimizer)."""
    total = converted["total"]
    return total // 3 if source == "hf" else total


def _table(peaks: list[Peak], converted: dict) -> str:
    rows = [
        f"{p.src:>8} -> {p.target:<8} anon {p.anon / MIB:6.1f} MiB  est {p.estimate / MIB:6.1f} MiB  "
        f"bound {_model_bytes(p.src, converted) / 3 / MIB:6.1f} MiB  rss {p.rss / MIB:6.1f} MiB"
        for p in peaks
    ]
    return "\n".join(rows)


@pytest.mark.parametrize("source", SOURCES)
def test_every_target_streams_under_a_third_of_the_model(converted: dict, source: str) -> None:
    """Peak RssAnon growth < model / 3 for ``source`` -> each target, and the dry-run estimate within 2x of it."""
    peaks = _measured(converted, source)
    assert [p.target for p in peaks] == list(TARGETS)
    table = _table(peaks, converted)
    print(table)
    over = [p for p in peaks if p.anon >= _model_bytes(p.src, converted) / 3]
    assert not over, "over the bound:\n" + table
    off = [p for p in peaks if not (p.anon <= 2 * p.estimate + SLACK and p.estimate <= 2 * p.anon + SLACK)]
    assert not off, "dry-run estimate off by more than 2x:\n" + table


def _files(root: Path, pattern: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob(pattern)) if p.is_file()}


@pytest.mark.parametrize(
    "target,pattern",
    [
        ("nxd", "model/*"),
        ("nxd", "optim/*"),
        ("nxd_xser", "model/**/*"),
        ("nxd_xser", "optim/**/*"),
        ("hf", "*.safetensors"),
        ("dcp", "*.distcp"),
    ],
)
def test_outputs_are_the_same_bytes_from_every_source(converted: dict, target: str, pattern: str) -> None:
    for s in SOURCES:
        _measured(converted, s)
    root = converted["root"]
    with_optimizer = pattern.startswith("optim") or target == "dcp"
    sources = [s for s in SOURCES if not (with_optimizer and s == "hf")]
    outs = {s: _files(root / f"out_{s}_{target}" / ("step_3" if target.startswith("nxd") else ""), pattern)
            for s in sources}  # fmt: skip
    want = outs["ckpt"]
    assert want, f"no {pattern} in the {target} output"
    for s, got in outs.items():
        assert sorted(got) == sorted(want), s
        differ = [n for n in want if got[n] != want[n]]
        assert not differ, f"{s} -> {target}: {differ[:3]} differ from ckpt -> {target}"


def _chunks(path: Path) -> dict[str, list]:
    m = manifest_dict(path)  # the v1 document of the stored manifest, whichever format version it is in
    return {
        n: [(s["offsets"], s["lengths"], s["checksum"]) for s in e["shards"]] for n, e in m["tensors"].items()
    }


def test_manifest_outputs_hold_the_generated_model(converted: dict) -> None:
    for s in SOURCES:
        _measured(converted, s)
    root = converted["root"]
    want = _chunks(root / "base")
    for s in SOURCES:
        got = _chunks(root / f"out_{s}_ckpt")
        names = [n for n in want if s != "hf" or not n.startswith("optim/")]
        assert sorted(got) == sorted(names), s
        differ = [n for n in names if got[n] != want[n]]
        assert not differ, f"{s} -> ckpt: {differ[:3]} differ from the generated model"


def test_zero1_shards_in_scratch_memory_equal_the_plain_ones() -> None:
    """The NxD writer's file-backed shard copies hold exactly what ``zero1.shard`` (pad, chunk, clone) makes."""
    import torch
    from ckpt.converters.nxd.scratch import Scratch

    from ckpt.layouts import zero1

    g = torch.Generator().manual_seed(0)
    with Scratch(min_bytes=0) as s:
        for rows in (1, 3, 7, 8, 100):
            for dp in (1, 2, 3, 5):
                t = torch.randn(rows, 5, generator=g)
                plain, mapped = zero1.shard_all(t, dp), zero1.shard_all(t, dp, s.empty)
                assert [x.shape for x in mapped] == [x.shape for x in plain], (rows, dp)
                assert all(torch.equal(x, y) for x, y in zip(plain, mapped, strict=True)), (rows, dp)
                assert all(y.untyped_storage().nbytes() == y.numel() * 4 for y in mapped)
