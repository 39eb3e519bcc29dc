"""Steps 4 and 5 of a save: write this rank's data file, then commit (collective) with rank 0 publishing last.

:func:`run` is what the background thread of an async save runs (or the caller's thread for a synchronous one):
each rank writes its data file and, in format 2, seals its own index and state file
(:func:`ckpt.format.publish.write_rank_files`); every rank reports to rank 0 (its summary or receipt, or its
error); rank 0 publishes the manifest (:func:`ckpt.format.publish.publish`) iff every rank succeeded, then tells
every rank the outcome.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import data as data_mod
from ..distributed import Collective
from ..errors import AsyncSaveError, CkptError, SaveRefusedError, StateMismatchError
from ..format import publish
from ..format.manifest import FORMAT_VERSION, Box, Layout, Manifest, TensorDesc
from ..state import rng_rule
from ..storage import Storage, refusal
from .staging import Staged


@dataclass(frozen=True)
class SaveResult:
    step: int
    path: str
    blocking_s: float
    total_s: float
    bytes_written: int


@dataclass
class SaveJob:
    """Everything the write and commit of one save need, prepared on the caller's thread."""

    storage: Storage
    step: int
    chunks: list[tuple[str, Box, torch.Tensor]]
    codec: str
    descs: list[
        tuple[int, TensorDesc]
    ]  # (position in this rank's state, description) of every tensor it writes
    trees: dict[str, Any]
    rank_trees: dict[str, Any]
    layout: Layout
    backend: str
    attempt: str
    started: float
    blocking_s: float
    on_commit: Callable[[SaveResult], None] | None = None
    rng_seed: int | None = None
    written: list[tuple[str, Box]] | None = None  # the boxes this rank writes, before chunking (format 2)
    staged: Staged | None = None
    # a stager's own data-file writer (ProcessStager.write_from_arena: a process reading its shared arena)
    write_elsewhere: publish.WriteElsewhere | None = None


def run(coll: Collective, job: SaveJob, format_version: int | None) -> SaveResult:
    """Write and commit ``job`` (every rank calls it); raises :class:`AsyncSaveError` on every rank when any
    rank failed, and nothing is committed then."""
    rank = coll.rank
    version = format_version or FORMAT_VERSION
    own_files = version == 2  # format 2: every rank seals its own index and state file
    receipt = publish.Receipt(rank)
    report: dict[str, Any] = {"ok": True, "rank": rank, "descs": job.descs}
    try:
        if job.staged is not None:
            job.staged.wait()  # lazy copies land in the arena before the writer reads it
        if job.chunks:
            publish.write_data_file(
                job.storage,
                receipt,
                publish.data_file_name(rank, job.attempt),
                job.chunks,
                job.codec,
                publish.data_file_metadata(job.step, rank),
                job.write_elsewhere,
            )
        if own_files:  # this rank's own index and state file; rank 0 gets their checksums and its boxes
            # a tensor is described by the writer of its first element only (T descriptions in all, not N x T;
            # the ranks agreed on every description in planning: plan_check / assign_writers)
            origin = {n for n, b in job.written or () if not any(b.offsets)}
            report["descs"] = [(pos, d) for pos, d in job.descs if d.name in origin]
            rng = job.rank_trees.get("rng")
            report["summary"] = publish.write_rank_files(
                job.storage, receipt, job.attempt, job.written or [], rng, job.rank_trees.get("data")
            )
            report["rng_digests"] = rng_rule.stream_digests(rng) if rng is not None else None
            report["has_data"] = "data" in job.rank_trees
            report["data_position"] = job.rank_trees.get("data_position")
            if rank == 0:
                report["rng"] = rng
        else:
            report.update(trees=job.rank_trees, receipt=receipt)
    except Exception as e:  # noqa: BLE001 - reported to rank 0 so that it does not commit
        report = {"ok": False, "rank": rank, "error": f"rank {rank}: {_why(e, job)}", "refused": _refused(e, job)}
    reports = coll.gather(report)
    outcome: dict[str, Any] = {"ok": True}
    if rank == 0:
        assert reports is not None
        failed = [r["error"] for r in reports if not r["ok"]]
        if failed:
            refused = all(r.get("refused") for r in reports if not r["ok"])
            outcome = {"ok": False, "error": "; ".join(failed), "refused": refused}
        else:
            try:
                manifest, written = (
                    _from_summaries(job, reports) if own_files else (_from_receipts(job, reports), None)
                )
                publish.publish(job.storage, manifest, version, written)
                outcome = {"ok": True, "bytes": manifest.total_bytes}
            except Exception as e:  # noqa: BLE001
                outcome = {"ok": False, "error": f"rank 0 commit: {_why(e, job)}", "refused": _refused(e, job)}
    outcome = coll.broadcast(outcome)
    if not outcome["ok"]:
        raise (SaveRefusedError if outcome.get("refused") else AsyncSaveError)(
            f"save of step {job.step} to {job.storage.display()} failed, not committed: {outcome['error']}"
        )
    result = SaveResult(
        job.step,
        job.storage.display(),
        job.blocking_s,
        time.perf_counter() - job.started,
        outcome.get("bytes", 0),
    )
    if rank == 0 and job.on_commit is not None:
        try:
            job.on_commit(result)
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed; housekeeping must not undo that
            warnings.warn(f"after committing step {job.step}: {type(e).__name__}: {e}", stacklevel=1)
    return result


def _why(exc: Exception, job: SaveJob) -> str:
    """A rank's failure as the error line says it: storage refusing a write (full disk, read-only, no permission)
    as its reason and file, anything else with its type."""
    return refusal.reason(exc, job.storage.display()) or f"{type(exc).__name__}: {exc}"


def _refused(exc: Exception, job: SaveJob) -> bool:
    return refusal.reason(exc, job.storage.display()) is not None


def _metas(reports: list[dict[str, Any]]) -> list[TensorDesc]:
    """Every written tensor's description, in the order the ranks hold them (position in the writer's state,
    then rank): the model's order for DDP/FSDP/HSDP/TP, where every rank holds the same names in one order."""
    metas: dict[str, tuple[tuple[int, int], TensorDesc]] = {}
    for r in reports:
        for pos, d in r["descs"]:
            seen = metas.get(d.name)
            if seen is None or (pos, r["rank"]) < seen[0]:
                metas[d.name] = ((pos, r["rank"]), d)
            if seen is not None and seen[1] != d:
                raise StateMismatchError(
                    f"tensor {d.name!r}: rank {r['rank']} has shape {list(d.shape)} {d.dtype}, rank "
                    f"{seen[0][1]} has {list(seen[1].shape)} {seen[1].dtype}"
                )
    return [d for _, d in sorted(metas.values(), key=lambda v: v[0])]


def _from_receipts(job: SaveJob, reports: list[dict[str, Any]]) -> Manifest:
    """Format 1: the whole manifest from every rank's receipt and trees."""
    receipts = [r["receipt"] for r in reports]
    trees = dict(job.trees)
    by_rank = sorted(reports, key=lambda r: r["rank"])
    if any("data" in r["trees"] for r in by_rank):
        trees["data_position"] = data_mod.merge_json(
            [r["trees"].get("data_position") for r in by_rank], trees.get("progress", {})
        )
    rng_records = {str(r["rank"]): r["trees"]["rng"] for r in by_rank if "rng" in r["trees"]}
    trees["rng_base"] = rng_rule.base_record(rng_records, job.rng_seed)
    return publish.build_manifest(
        step=job.step,
        backend=job.backend,
        layout=job.layout,
        metas=_metas(reports),
        receipts=receipts,
        trees=trees,
        rank_trees={r["receipt"].rank: r["trees"] for r in reports},
    )


def _from_summaries(job: SaveJob, reports: list[dict[str, Any]]) -> tuple[Manifest, publish.RankFiles]:
    """Format 2: the manifest from every rank's summary, and the per-rank files the ranks wrote."""
    trees = dict(job.trees)
    by_rank = sorted(reports, key=lambda r: r["rank"])
    if any(r["has_data"] for r in by_rank):
        trees["data_position"] = data_mod.merge_json(
            [r["data_position"] for r in by_rank], trees.get("progress", {})
        )
    digests = [r["rng_digests"] for r in by_rank if r["rng_digests"] is not None]
    if digests:
        first = next(r for r in by_rank if r["rng_digests"] is not None)
        if (
            first["rank"] != 0
        ):  # only rank 0 sends its whole record; the lowest rank holding one is 0 in practice
            raise CkptError(f"rank 0 saved no RNG state but rank {first['rank']} did")
        trees["rng_base"] = rng_rule.base_record_of(first["rng"], digests, job.rng_seed)
    return publish.manifest_from_summaries(
        step=job.step,
        backend=job.backend,
        layout=job.layout,
        metas=_metas(reports),
        summaries=[r["summary"] for r in by_rank],
        trees=trees,
    )


__all__ = ["SaveJob", "SaveResult", "run"]
