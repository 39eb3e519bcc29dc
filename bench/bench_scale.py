"""Scale harness: the real planning, commit and restore-planning code for N simulated ranks in one process.

    .venv/bin/python bench/bench_scale.py [--quick] [--json bench/results/scale_ranks.json] [--plot docs/scale.png]

Layouts (what each simulated rank holds, as the saver would describe it):

- ``fsdp``: FSDP2, every tensor ``Shard(0)`` over a 1-d mesh of N ranks;
- ``hsdp``: HSDP, mesh (N/8 replicate, 8 shard), ``(Replicate(), Shard(0))``;
- ``nxd``: NxD TP 8 x PP 4 x DP (N/32), parameters TP-split (90%) or replicated (norms, 10%) and replicated over
  DP, optimizer state (two thirds of the tensors) ZeRO-1 row-sharded over DP;
- ``ddp``: every tensor whole on every rank.

T logical tensors (bf16 matrices 4096 x {4096, 11008, 1024}, every tenth a 4096 norm).  For each (layout, N, T)
the harness measures, per rank:

- planning: ``before`` = today's path (``all_gather`` of every rank's pieces + ``assign_writers`` over all of
  them, run on every rank); ``after`` = the scalable path (``ckpt.saving.planning.plan_local`` on the rank's own pieces
  with replica groups derived from its placements, an O(1) ``all_reduce`` check), timed on a few representative
  ranks (sampling: rank 0, N/2 and N-1; the others are the same computation on different numbers);
- bytes moved by the planning collectives, per rank (received + sent, pickled sizes as ``all_gather_object``
  sends them; the fake collective counts them);
- commit: ``before``: rank 0 building the v1 manifest from every rank's receipt (every chunk); ``after``: each
  writer sealing its own index and state file (slowest rank reported), rank 0 checking the written boxes and
  writing the v2 top manifest (``ckpt.format.publish``); the bytes every rank sends rank 0, and the manifest's size;
- restore: one rank of a resharded job (N -> N/2 and N -> 2N) reading the metadata it needs and planning which
  stored chunks to read for its boxes (``ckpt.format.reader.overlapping``), without reading data.

Cases whose ``before`` path would hold more than ``--max-pieces`` pieces in memory are extrapolated linearly in
N x T from the largest measured case of the same layout and T (marked ``~`` in the table): that path is linear in
N x T by construction (one pass over every rank's pieces; JSON of every shard).

CPU times are single-threaded process times (``time.process_time``), best of ``--repeat``, with the harness's own
objects frozen out of the garbage collector (:func:`best`).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from ckpt.format.index import Locator, top_text  # noqa: E402
from ckpt.format.manifest import Box, Layout, Manifest, TensorDesc  # noqa: E402
from ckpt.format.publish import (  # noqa: E402
    Receipt,
    build_manifest,
    data_file_name,
    manifest_from_summaries,
    write_rank_files,
)
from ckpt.format.reader import overlapping  # noqa: E402
from ckpt.neuron.parallel import ParallelInfo  # noqa: E402
from ckpt.neuron.partition import NxdLayout  # noqa: E402
from ckpt.saving.planning import (  # noqa: E402
    DEFAULT_CHUNK_BYTES,
    Group,
    HeldBox,
    assign_writers,
    chunk_boxes,
    mesh_group,
    plan_check,
    plan_local,
    world_group,
)
from ckpt.state import rng as rng_mod  # noqa: E402
from ckpt.state.rng_rule import base_record_of, stream_digests  # noqa: E402
from ckpt.state.training import NamedTensor  # noqa: E402
from ckpt.storage import open_storage  # noqa: E402

HIDDEN = 4096
SHARD_GROUP = 8  # HSDP shard-group size (one node)
TP, PP = 8, 4


# ------------------------------------------------------------------------------------------------ the model


def model_descs(t: int) -> list[TensorDesc]:
    """T logical tensors: every third a parameter, followed by its two Adam states."""
    out: list[TensorDesc] = []
    i = 0
    while len(out) < t:
        rows = (HIDDEN, 11008, 1024)[i % 3]
        shape: tuple[int, ...] = (HIDDEN,) if i % 10 == 9 else (rows, HIDDEN)
        name = f"model.layers.{i // 10}.p{i % 10}.weight"
        out.append(TensorDesc(name, "parameter", shape, "BF16"))
        for key in ("exp_avg", "exp_avg_sq"):
            if len(out) < t:
                out.append(TensorDesc(f"optim/{name}/{key}", "optimizer_state", shape, "F32", name, key))
        i += 1
    return out


def split(length: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of part ``index`` of ``parts`` (torch.chunk / DTensor Shard semantics)."""
    size = -(-length // parts)
    start = min(size * index, length)
    return start, max(0, min(size, length - start))


def dim0_box(shape: tuple[int, ...], parts: int, index: int) -> Box:
    off, n = split(shape[0], parts, index)
    return Box((off, *(0 for _ in shape[1:])), (n, *shape[1:]))


# ------------------------------------------------------------------------------------------------ layouts


@dataclass
class Sim:
    """What every rank of one simulated job holds."""

    kind: str
    world: int
    descs: list[TensorDesc]

    @property
    def nxd_sizes(self) -> tuple[int, int, int]:
        tp = min(TP, self.world)
        pp = PP if self.world >= TP * PP else 1
        return tp, pp, self.world // (tp * pp)

    def layout(self) -> Layout:
        if self.kind == "nxd":
            tp, pp, dp = self.nxd_sizes
            return Layout(world_size=self.world, tp=tp, pp=pp, dp=dp, zero_stage=1, kind="nxd")
        if self.kind in ("fsdp", "hsdp"):
            shape = [self.world] if self.kind == "fsdp" else [self.world // SHARD_GROUP, SHARD_GROUP]
            return Layout(world_size=self.world, dp=self.world, mesh={"shape": shape}, kind="dtensor")
        return Layout(world_size=self.world, dp=self.world)

    def pieces(self, rank: int) -> list[HeldBox]:
        """The pieces ``rank`` holds, as ``ckpt.saving.writers.WriterPlanner.describe`` makes them (empty boxes dropped for NxD
        ZeRO-1 as capture_zero1 drops them; DTensor ranks keep their empty boxes)."""
        out: list[HeldBox] = []
        if self.kind == "ddp":
            return [HeldBox(d, Box.full(d.shape)) for d in self.descs]
        if self.kind == "fsdp":
            return [HeldBox(d, dim0_box(d.shape, self.world, rank)) for d in self.descs]
        if self.kind == "hsdp":
            s = rank % SHARD_GROUP
            return [HeldBox(d, dim0_box(d.shape, SHARD_GROUP, s)) for d in self.descs]
        tp, pp, dp = self.nxd_sizes
        tp_rank, pp_rank, dp_rank = rank % tp, (rank // tp) % pp, rank // (tp * pp)
        per_stage = -(-len(self.descs) // pp)
        for i, d in enumerate(self.descs[pp_rank * per_stage : (pp_rank + 1) * per_stage]):
            box = Box.full(d.shape)
            if len(d.shape) == 2:  # TP-partitioned on dim 0
                box = dim0_box(d.shape, tp, tp_rank)
            if d.role == "optimizer_state":  # ZeRO-1: rows of the TP-local shard over DP
                off, n = split(box.lengths[0], dp, dp_rank)
                if n == 0:
                    continue
                box = Box((box.offsets[0] + off, *box.offsets[1:]), (n, *box.lengths[1:]))
            out.append(HeldBox(d, box))
            del i
        return out


def groups(sim: Sim, rank: int, pieces: list[HeldBox]) -> list[Group]:
    """The replica group of each piece, derived as the saver derives it (planning.mesh_group for DTensors,
    NxdLayout.replica_group for NxD, planning.world_group for plain tensors)."""
    n = sim.world
    if sim.kind == "ddp":
        return [world_group(rank, n)] * len(pieces)
    if sim.kind == "fsdp":
        return [mesh_group(1, (n,), [False], (rank,))] * len(pieces)
    if sim.kind == "hsdp":
        shape = (n // SHARD_GROUP, SHARD_GROUP)
        g = mesh_group(1, shape, [True, False], (rank // SHARD_GROUP, rank % SHARD_GROUP))
        return [g] * len(pieces)
    tp, pp, dp = sim.nxd_sizes
    info = ParallelInfo(
        tp_rank=rank % tp,
        tp_size=tp,
        pp_rank=(rank // tp) % pp,
        pp_size=pp,
        dp_rank=rank // (tp * pp),
        dp_size=dp,
    )
    layout = NxdLayout(None, info, rule_set=None)
    out = []
    for p in pieces:
        d = p.desc
        if d.role == "optimizer_state":
            layout.zero1_rows[d.name] = (0, d.shape)
        part = {"dim": 0, "stride": 1, "tp": tp, "source": "attributes"} if len(d.shape) == 2 else None
        g = layout.replica_group(NamedTensor(d.name, None, d.role, d.param, d.key), part)  # type: ignore[arg-type]
        assert g is not None
        out.append(g)
    return out


def restore_boxes(kind: str, world: int, descs: list[TensorDesc], rank: int) -> list[HeldBox]:
    """The boxes rank ``rank`` of a job of ``world`` ranks (same layout family) restores."""
    return Sim(kind, world, descs).pieces(rank)


# ------------------------------------------------------------------------------------------------ fake collective


class FakeCollective:
    """Counts the bytes one rank sends and receives; contributions of other ranks come from ``others(rank)``."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world
        self.sent = 0
        self.received = 0

    def all_gather_sizes(self, sizes: list[int]) -> None:
        self.sent += sizes[self.rank]
        self.received += sum(sizes) - sizes[self.rank]

    def all_reduce(self, nbytes: int) -> None:
        # ring all-reduce: each rank sends and receives about twice the payload, whatever the world size
        self.sent += 2 * nbytes
        self.received += 2 * nbytes

    def broadcast(self, nbytes: int) -> None:
        if self.rank == 0:
            self.sent += nbytes
        else:
            self.received += nbytes


# ------------------------------------------------------------------------------------------------ measurements


def best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Best process time of ``repeat`` calls.  The harness holds every simulated rank's data (millions of objects)
    that no real rank holds; they are frozen out of the garbage collector's scans while timing, so that a
    collection triggered by the timed code does not walk them (it did: up to 2/3 of a DDP restore's time)."""
    import gc

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


def samples(world: int) -> list[int]:
    return sorted({0, world // 2, world - 1})


def receipts_for(sim: Sim, plan: Callable[[int], list[HeldBox]], rng_tree: Any) -> list[dict[str, Any]]:
    """Every rank's commit report (as ``ckpt.saving.commit.run`` sends it): its receipt and per-rank trees."""
    out = []
    for r in range(sim.world):
        rec = Receipt(r)
        fname = data_file_name(r, "a1b2c3d4")
        pos = 64
        for p in plan(r):
            for b in chunk_boxes(p.box, p.itemsize, DEFAULT_CHUNK_BYTES):
                n = b.numel * p.itemsize
                rec.shards.append(
                    (p.name, b.offsets, b.lengths, fname, pos, n, "raw", "xxh3_64:0123456789abcdef")
                )
                pos += n
        if rec.shards:
            rec.files.append((fname, pos))
        descs = [(0, p.desc) for p in plan(r)]  # as ckpt.saving.commit.run sends them (v1: every tensor it writes)
        out.append({"ok": True, "rank": r, "trees": {"rng": rng_tree}, "receipt": rec, "descs": descs})
    return out


def before(sim: Sim, repeat: int) -> dict[str, Any]:
    """Today's path, measured."""
    per_rank = [sim.pieces(r) for r in range(sim.world)]
    res: dict[str, Any] = {}
    res["plan_s"], plan = best(lambda: assign_writers(per_rank), repeat)
    sizes = [len(pickle.dumps(p)) for p in per_rank]
    coll = FakeCollective(0, sim.world)
    coll.all_gather_sizes(
        [len(pickle.dumps(("0" * 32, {"attempt": "a1b2c3d4", "exists": False})))] * sim.world
    )
    coll.all_gather_sizes(sizes)
    res["plan_bytes"] = coll.sent + coll.received
    mine: dict[int, list[HeldBox]] = {}
    for r, pieces in enumerate(per_rank):
        for p in pieces:
            if plan[(p.name, p.box)] == r:
                mine.setdefault(r, []).append(p)
    rng_tree = rng_mod.capture()
    reports = receipts_for(sim, lambda r: mine.get(r, []), rng_tree)
    res["commit_in_bytes"] = sum(len(pickle.dumps(rep)) for rep in reports)
    metas = {d.name: d for d in sim.descs}

    def commit() -> str:
        m = build_manifest(
            step=1,
            backend="cuda",
            layout=sim.layout(),
            metas=metas.values(),
            receipts=[rep["receipt"] for rep in reports],
            trees={},
            rank_trees={rep["rank"]: rep["trees"] for rep in reports},
            env={},
        )
        return m.to_json()

    res["commit_s"], text = best(commit, repeat)
    raw = text.encode()
    res["manifest_bytes"] = len(raw)
    res["shards"] = sum(len(rep["receipt"].shards) for rep in reports)
    for label, world2 in (("half", max(1, sim.world // 2)), ("double", sim.world * 2)):
        want = restore_boxes(sim.kind, world2, sim.descs, world2 // 2)

        def plan_restore(want: list[HeldBox] = want) -> int:
            m = Manifest.from_json(raw)
            return sum(len(overlapping(m.tensors[p.name], p.box)) for p in want)

        res[f"restore_{label}_s"], _ = best(plan_restore, repeat)
    return res


def after(sim: Sim, repeat: int) -> dict[str, Any]:
    """The local planning path, timed on sampled ranks (the slowest reported)."""
    res: dict[str, Any] = {"plan_s": 0.0, "plan_bytes": 0, "writes_max": 0}
    for r in samples(sim.world):
        pieces = sim.pieces(r)
        gs = groups(sim, r, pieces)
        t, (write, _) = best(lambda pieces=pieces, gs=gs: plan_local(pieces, gs), repeat)
        coll = FakeCollective(r, sim.world)
        coll.broadcast(len(pickle.dumps({"attempt": "a1b2c3d4", "exists": False})))
        coll.all_reduce(3 * 8)
        res["plan_s"] = max(res["plan_s"], t)
        res["plan_bytes"] = max(res["plan_bytes"], coll.sent + coll.received)
        res["writes_max"] = max(
            res["writes_max"], sum(p.nbytes for p, w in zip(pieces, write, strict=True) if w)
        )
    if sim.world * len(sim.descs) <= 300_000:  # every rank once: the simulated groups pass the saver's check
        a = b = 0
        writers: dict[tuple[str, Box], int] = {}
        for r in range(sim.world):
            pieces = sim.pieces(r)
            write, (x, y) = plan_local(pieces, groups(sim, r, pieces))
            a, b = a + x, b + y
            for p, w in zip(pieces, write, strict=True):
                writers[(p.name, p.box)] = writers.get((p.name, p.box), 0) + w
        res["check"] = plan_check((a, b)) and all(v == 1 for k, v in writers.items() if k[1].numel)
    return res


def after_commit(sim: Sim, rng_tree: Any, repeat: int) -> dict[str, Any]:
    """Commit and restore with format v2 as the saver runs it (ckpt.format.publish): each writer seals its own index and
    state file (timed per rank, slowest reported), rank 0 checks the written boxes and writes the top manifest;
    writers from the local planning (every rank planned once)."""
    import tempfile

    mine: dict[int, list[HeldBox]] = {}
    for r in range(sim.world):
        pieces = sim.pieces(r)
        write, _ = plan_local(pieces, groups(sim, r, pieces))
        mine[r] = [p for p, w in zip(pieces, write, strict=True) if w]
    reports = receipts_for(sim, lambda r: mine[r], rng_tree)
    res: dict[str, Any] = {"writer_s": 0.0}
    digests = stream_digests(rng_tree)
    with tempfile.TemporaryDirectory(prefix="ckpt-scale-") as d:
        storage = open_storage(d)
        summaries = []
        for rep in reports:
            r = rep["rank"]
            t0 = time.process_time()
            summary = write_rank_files(
                storage, rep["receipt"], "a1b2c3d4", [(p.name, p.box) for p in mine[r]], rng_tree, None
            )
            res["writer_s"] = max(res["writer_s"], time.process_time() - t0)
            summaries.append(summary)
        # what each rank sends rank 0 (ckpt.saving.commit.run): its summary, the descriptions of what it writes, the
        # digests of its RNG streams
        res["commit_in_bytes"] = sum(
            len(
                pickle.dumps(
                    {
                        "ok": True,
                        "rank": s.rank,
                        "summary": s,
                        "descs": [(0, p.desc) for p in mine[s.rank] if not any(p.box.offsets)],
                        "rng_digests": digests,
                        "has_data": False,
                        "data_position": None,
                    }
                )
            )
            for s in summaries
        )

        def commit() -> str:
            trees = {"rng_base": base_record_of(rng_tree, [digests] * sim.world, None)}
            m, written = manifest_from_summaries(
                step=1,
                backend="cuda",
                layout=sim.layout(),
                metas=sim.descs,
                summaries=summaries,
                trees=trees,
                env={},
            )
            return top_text(m, written.pieces, written.indexes, written.states)  # what publish() writes

        res["commit_s"], top = best(commit, repeat)
        res["manifest_bytes"] = len(top.encode())
        res["index_bytes_max"] = max(s.index.size for s in summaries if s.index is not None)
        res["state_bytes_max"] = max(s.state.size for s in summaries if s.state is not None)
        res["shards"] = sum(len(rep["receipt"].shards) for rep in reports)
        raw = top.encode()
        for label, world2 in (("half", max(1, sim.world // 2)), ("double", sim.world * 2)):
            rank2 = world2 // 2
            want = restore_boxes(sim.kind, world2, sim.descs, rank2)

            def plan_restore(want: list[HeldBox] = want, rank2: int = rank2) -> tuple[int, int]:
                m = Manifest.from_json(raw)
                loc = Locator(storage, m, m.v2, "manifest.json")
                n = 0
                for p in want:
                    n += sum(1 for sh in loc.shards(p.name, p.box) if sh.box.intersect(p.box) is not None)
                loc.rank_trees(min(rank2, sim.world - 1))  # the restoring rank's RNG: one state file
                return n, len(loc.layout.loaded)

            res[f"restore_{label}_s"], (_, res[f"restore_{label}_indexes"]) = best(plan_restore, repeat)
    return res


def extrapolate(points: list[tuple[int, dict[str, Any]]], n: int) -> dict[str, Any]:
    """Each figure on the line through the two largest measured world sizes (the path is linear in N)."""
    (n1, m1), (n2, m2) = points[-2:]
    out: dict[str, Any] = {"extrapolated": True}
    for k, v2 in m2.items():
        if k.endswith("_indexes"):  # how many indexes a restoring rank reads depends on the layout, not on N
            out[k] = v2
        elif isinstance(v2, (int, float)) and not isinstance(v2, bool):
            out[k] = max(0.0, v2 + (v2 - m1[k]) / (n2 - n1) * (n - n2))
    return out


# ------------------------------------------------------------------------------------------------ driver


def run(
    layouts: list[str],
    worlds: list[int],
    counts: list[int],
    repeat: int,
    max_pieces: int,
    modes: list[str],
    max_pieces_after: int,
) -> list[dict[str, Any]]:
    rows = []
    ref: dict[tuple[str, int], list[tuple[int, dict[str, Any]]]] = {}
    ref_after: dict[tuple[str, int], list[tuple[int, dict[str, Any]]]] = {}
    for kind in layouts:
        for t in counts:
            descs = model_descs(t)
            for n in worlds:
                sim = Sim(kind, n, descs)
                row: dict[str, Any] = {"layout": kind, "ranks": n, "tensors": t}
                pieces = n * t
                if "before" in modes:
                    if pieces <= max_pieces or len(ref.get((kind, t), [])) < 2:
                        row["before"] = before(sim, repeat)
                        ref.setdefault((kind, t), []).append((n, row["before"]))
                    else:
                        row["before"] = extrapolate(ref[(kind, t)], n)
                if "after" in modes:
                    row["after"] = after(sim, repeat)
                    if pieces <= max_pieces_after or len(ref_after.get((kind, t), [])) < 2:
                        row["after_commit"] = after_commit(sim, rng_mod.capture(), repeat)
                        ref_after.setdefault((kind, t), []).append((n, row["after_commit"]))
                    else:
                        row["after_commit"] = extrapolate(ref_after[(kind, t)], n)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def plot(paths: list[str], out: str) -> None:
    """Log-log plot of one T: planning CPU per rank, planning bytes per rank, manifest bytes, restore planning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for p in paths for r in json.load(open(p))]
    t = (
        max(r["tensors"] for r in rows if r["tensors"] == 1000)
        if any(r["tensors"] == 1000 for r in rows)
        else 0
    )
    rows = [r for r in rows if r["tensors"] == t and "before" in r and "after" in r]
    panels = [
        ("planning CPU per rank (s)", lambda r: r["before"]["plan_s"], lambda r: r["after"]["plan_s"]),
        ("planning bytes per rank", lambda r: r["before"]["plan_bytes"], lambda r: r["after"]["plan_bytes"]),
        (
            "manifest bytes (v1 / v2 top)",
            lambda r: r["before"]["manifest_bytes"],
            lambda r: r["after_commit"]["manifest_bytes"],
        ),
        (
            "restore N->N/2: metadata + plan, one rank (s)",
            lambda r: r["before"]["restore_half_s"],
            lambda r: r["after_commit"]["restore_half_s"],
        ),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    colors = {"fsdp": "C0", "hsdp": "C1", "nxd": "C2", "ddp": "C3"}
    for ax, (title, old, new) in zip(axes, panels, strict=True):
        for kind, color in colors.items():
            rs = sorted((r for r in rows if r["layout"] == kind), key=lambda r: r["ranks"])
            if not rs:
                continue
            xs = [r["ranks"] for r in rs]
            ax.plot(xs, [old(r) for r in rs], "--o", color=color, ms=3, label=f"{kind} before")
            pts = [(r["ranks"], new(r)) for r in rs if new(r) is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], "-s", color=color, ms=3, label=f"{kind} after")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"bench/bench_scale.py, T = {t} tensors (before: past 256 ranks extrapolated; after: manifest past 1,024 "
        "extrapolated, restore at 8,192 = measured N part + measured T part, docs/performance.md)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def table(paths: list[str]) -> str:
    """The markdown table of docs/performance.md ("Scale")."""

    def fmt_s(v: float) -> str:
        return f"{v:.3g}" if v < 100 else f"{v:.0f}"

    def fmt_b(v: float) -> str:
        for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if v >= div:
                return f"{v / div:.3g} {unit}"
        return f"{v:.0f} B"

    lines = [
        "| layout | ranks | T | plan CPU/rank before | after | plan bytes/rank before | after | manifest before (v1) "
        "| after (v2 top) | largest index | commit CPU rank 0 before | after | writer CPU/rank after "
        "| bytes to rank 0 before | after | restore N/2 before | after "
        "| restore 2N before | after | indexes read (N/2, 2N) |",
        "|---" * 20 + "|",
    ]
    for p in paths:
        for r in json.load(open(p)):
            b, a, c = r.get("before", {}), r.get("after", {}), r.get("after_commit", {})
            mb = "~" if b.get("extrapolated") else ""
            mc = "~" if c.get("extrapolated") else ""
            lines.append(
                f"| {r['layout']} | {r['ranks']} | {r['tensors']} | {mb}{fmt_s(b['plan_s'])} | {fmt_s(a['plan_s'])} "
                f"| {mb}{fmt_b(b['plan_bytes'])} | {fmt_b(a['plan_bytes'])} | {mb}{fmt_b(b['manifest_bytes'])} "
                f"| {mc}{fmt_b(c['manifest_bytes'])} | {mc}{fmt_b(c['index_bytes_max'])} | {mb}{fmt_s(b['commit_s'])} "
                f"| {mc}{fmt_s(c['commit_s'])} | {mc}{fmt_s(c.get('writer_s', float('nan')))} "
                f"| {mb}{fmt_b(b['commit_in_bytes'])} | {mc}{fmt_b(c['commit_in_bytes'])} "
                f"| {mb}{fmt_s(b['restore_half_s'])} | {mc}{fmt_s(c['restore_half_s'])} "
                f"| {mb}{fmt_s(b['restore_double_s'])} | {mc}{fmt_s(c['restore_double_s'])} "
                f"| {mc}{c['restore_half_indexes']:.0f}, {c['restore_double_indexes']:.0f} |"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="fsdp,hsdp,nxd,ddp")
    p.add_argument("--ranks", default="8,64,256,1024,8192")
    p.add_argument("--tensors", default="1000")
    p.add_argument("--modes", default="before")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--max-pieces", type=int, default=300_000)
    p.add_argument("--max-pieces-after", type=int, default=1_100_000)
    p.add_argument("--json", default=os.path.join(HERE, "results", "scale_ranks.json"))
    p.add_argument(
        "--plot", nargs="*", help="draw docs/scale.png from these result files (and print the table)"
    )
    args = p.parse_args()
    if args.plot:
        plot(args.plot, os.path.join(HERE, "..", "docs", "scale.png"))
        print(table(args.plot))
        return 0
    rows = run(
        args.layouts.split(","),
        [int(x) for x in args.ranks.split(",")],
        [int(x) for x in args.tensors.split(",")],
        args.repeat,
        args.max_pieces,
        args.modes.split(","),
        args.max_pieces_after,
    )
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
