"""Rank 0's share of a format-2 commit at 8 to 8,192 simulated ranks, before and after the array check, in one run.

    .venv/bin/python bench/bench_commit_scale.py [--layouts fsdp] [--ranks 8,64,256,1024,4096,8192] [--tensors 1000]
        [--json bench/results/commit_scale.json] [--append]
    .venv/bin/python bench/bench_commit_scale.py --plot bench/results/commit_scale_fsdp.json  # docs/commit_scale.png

Each simulated rank's boxes are what the saver's local planning makes it write (``bench_scale.Sim``,
``ckpt.saving.planning.plan_local``: the same layouts and model as ``bench/bench_scale.py``); its report to rank 0
carries a :class:`ckpt.format.publish.RankSummary` as ``write_rank_files`` makes it (the index and state files
themselves are the writers' work, not rank 0's, and are not written here).  Measured on rank 0, per (layout, N):

- ``receive_s``: unpickling every rank's report (what ``Collective.gather`` hands rank 0), and ``bytes_to_rank0``;
- ``commit_s``: ``manifest_from_summaries`` plus the top manifest's text (``top_text``, what ``publish`` writes);
- ``restore_plan_s``: a restoring rank (N/2 of a job of N/2 ranks) parsing the top manifest and finding the ranks
  whose indexes it must read for its boxes (``PiecesSpec.ranks_for``), the part of a restore that grows with N.

``before``: the per-box path (``ckpt.format.tiling.tile_one_by_one``: the algorithm rank 0 ran before, one
``check_box`` per box, then ``describe_boxes`` per tensor) on summaries whose boxes are a list of tuples, as they
were sent before; ``after``: ``tile`` on packed boxes.  Both top manifests are compared (equal but for the time
stamp and seal).  CPU times: ``time.process_time``, best of ``--repeat`` (1 past ``--max-repeat-ranks``), the
harness's own objects frozen out of the garbage collector.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from bench_scale import Sim, groups, model_descs  # noqa: E402

from ckpt.format import publish  # noqa: E402
from ckpt.format.index import index_name, state_name, top_text  # noqa: E402
from ckpt.format.manifest import Manifest  # noqa: E402
from ckpt.format.placement import IndexEntry  # noqa: E402
from ckpt.format.tiling import PackedBoxes, tile, tile_one_by_one  # noqa: E402
from ckpt.saving.planning import plan_local  # noqa: E402

CSUM = "xxh3_64:0123456789abcdef"


def boxes(sim: Sim) -> list[list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """The boxes each rank writes, from the saver's local planning."""
    out = []
    for r in range(sim.world):
        pieces = sim.pieces(r)
        write, _ = plan_local(pieces, groups(sim, r, pieces))
        out.append([(p.name, p.box.offsets, p.box.lengths) for p, w in zip(pieces, write, strict=True) if w])
    return out


def reports(sim: Sim, written: list[list[Any]], packed: bool) -> list[bytes]:
    """Every rank's pickled commit report (format 2), as ``ckpt.saving.commit.run`` sends it."""
    out = []
    for r, mine in enumerate(written):
        s = publish.RankSummary(
            r,
            [(publish.data_file_name(r, "a1b2c3d4"), 64 + sum(64 * 1024 for _ in mine))] if mine else [],
            PackedBoxes(mine) if packed else mine,
        )
        if mine:
            s.index = IndexEntry(index_name(r, "a1b2c3d4"), r, 100 * len(mine), CSUM)
        s.state = IndexEntry(state_name(r, "a1b2c3d4"), r, 16000, CSUM, ("rng",))
        origin = {n for n, offs, _ in mine if not any(offs)}
        descs = [(i, d) for i, d in enumerate(sim.descs) if d.name in origin]
        out.append(pickle.dumps({"ok": True, "rank": r, "summary": s, "descs": descs, "rng_digests": None}))
    return out


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times, out = [], None
    gc.collect()
    gc.freeze()
    try:
        for _ in range(repeat):
            t0 = time.process_time()
            out = fn()
            times.append(time.process_time() - t0)
    finally:
        gc.unfreeze()
    return min(times), out


def measure(sim: Sim, written: list[list[Any]], packed: bool, repeat: int) -> tuple[dict[str, Any], str]:
    raw = reports(sim, written, packed)
    res: dict[str, Any] = {"bytes_to_rank0": sum(map(len, raw))}
    res["receive_s"], got = timed(lambda raw=raw: [pickle.loads(b) for b in raw], repeat)
    del raw
    summaries = [r["summary"] for r in got]
    publish.tile = tile if packed else tile_one_by_one  # type: ignore[attr-defined]
    try:

        def commit() -> str:
            m, w = publish.manifest_from_summaries(
                step=1,
                backend="cuda",
                layout=sim.layout(),
                metas=sim.descs,
                summaries=summaries,
                trees={},
                env={},
            )
            return top_text(m, w.pieces, w.indexes, w.states)

        res["commit_s"], text = timed(commit, repeat)
    finally:
        publish.tile = tile  # type: ignore[attr-defined]
    res["manifest_bytes"] = len(text.encode())
    res["boxes"] = sum(len(s.pieces) for s in summaries)
    world2 = max(1, sim.world // 2)
    want = Sim(sim.kind, world2, sim.descs).pieces(world2 // 2)

    def restore_plan() -> int:
        m = Manifest.from_json(text.encode())
        assert m.v2 is not None
        return len(set().union(*(m.v2.pieces[p.name].ranks_for(p.desc.shape, p.box) for p in want)))

    res["restore_plan_s"], res["restore_indexes"] = timed(restore_plan, repeat)
    return res, text


def same_manifest(a: str, b: str) -> bool:
    """Equal top manifests but for the time stamp (and so the seal)."""
    da, db = json.loads(a), json.loads(b)
    for d in (da, db):
        d.pop("checksum")
        d.pop("created_at")
    return da == db


def plot(path: str, out: str) -> None:
    """Log-log curve of rank 0's commit CPU and report unpickling, before and after, against N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in json.load(open(path)) if "before" in r), key=lambda r: r["ranks"])
    xs = [r["ranks"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for key, label, color in (("commit_s", "commit", "C0"), ("receive_s", "unpickling the reports", "C1")):
        ax.plot(xs, [r["before"][key] for r in rows], "--o", color=color, ms=3, label=f"{label}, before")
        ax.plot(xs, [r["after"][key] for r in rows], "-s", color=color, ms=3, label=f"{label}, after")
    ax.axhline(5, color="gray", lw=0.8, ls=":", label="goal: 5 s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (FSDP, 1,000 tensors)")
    ax.set_ylabel("rank 0 CPU (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("bench/bench_commit_scale.py: rank 0's format-2 commit", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="fsdp")
    p.add_argument("--ranks", default="8,64,256,1024,4096,8192")
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--max-repeat-ranks", type=int, default=1024)
    p.add_argument("--modes", default="before,after")
    p.add_argument("--json", default=os.path.join(HERE, "results", "commit_scale.json"))
    p.add_argument("--append", action="store_true", help="add the rows to those already in --json")
    p.add_argument("--plot", help="draw docs/commit_scale.png from this result file, and measure nothing")
    args = p.parse_args()
    if args.plot:
        plot(args.plot, os.path.join(HERE, "..", "docs", "commit_scale.png"))
        return 0
    rows = json.load(open(args.json)) if args.append and os.path.exists(args.json) else []
    descs = model_descs(args.tensors)
    for kind in args.layouts.split(","):
        for n in (int(x) for x in args.ranks.split(",")):
            sim = Sim(kind, n, descs)
            repeat = args.repeat if n <= args.max_repeat_ranks else 1
            row: dict[str, Any] = {"layout": kind, "ranks": n, "tensors": args.tensors, "repeat": repeat}
            texts = {}
            written = boxes(sim)
            for mode in args.modes.split(","):
                row[mode], texts[mode] = measure(sim, written, mode == "after", repeat)
                gc.collect()
            if len(texts) == 2:
                row["same_manifest"] = same_manifest(texts["before"], texts["after"])
                row["commit_ratio"] = row["before"]["commit_s"] / max(row["after"]["commit_s"], 1e-9)
            row["load_avg_1min"] = os.getloadavg()[0]
            del written
            rows.append(row)
            print(json.dumps(row), flush=True)
            os.makedirs(os.path.dirname(args.json), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
