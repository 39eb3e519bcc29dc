"""``convert``: detect the source format, plan, check everything, then write the target atomically.

Formats (one module each, same verbs ``open_*`` / ``write_*``): our manifest (``ckpt_layout``), Hugging Face
(``hf``), torch DCP (``dcp``), NxD-native tags (``nxd_tag``).  Every impossible request raises a one-line
``CkptError`` from :func:`plan_conversion`, before any byte is written.  SRC is only ever read.

Parallelism: ``workers=N`` runs N local processes, each converting a disjoint, byte-balanced share of the
output into its own files; the parent commits.  Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) each rank
converts its share and rank 0 commits after gathering the receipts over a gloo group, so many machines can convert
one checkpoint together.  Our manifest: shares of target tensors, the manifest is the commit.  HF / DCP / NxD
folders (:mod:`.parallel`): shares of whole files (HF shards, DCP write items per ``__<w>_0.distcp``, NxD (tp, pp)
ranks) in one temp folder made by the coordinator, whose index/metadata/``done`` and rename are the commit.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ckpt.commit import Receipt
from ckpt.errors import CheckpointExistsError, CkptError, LayoutError
from ckpt.layouts import LayoutSpec
from ckpt.manifest import MANIFEST_NAME
from ckpt.storage import open_storage
from ckpt.writer import StreamingWriter

from .ckpt_layout import (
    Conversion,
    ManifestSource,
    Source,
    assign_shares,
    commit,
    plan_to_cuda,
    plan_to_neuron,
    write_share,
)
from .dcp import DcpExport, check_dcp_export, is_dcp_dir, open_dcp
from .hf import HFExport, check_hf_export, is_hf_dir, open_hf
from .nxd_tag import NxdExport, is_nxd_dir, open_nxd
from .parallel import FolderExport, UnitReceipt, balance, submit, worker_pool, write_serial

Format = Literal["ckpt", "hf", "dcp", "nxd"]
DEFAULT_FLUSH_BYTES = 64 << 20


@dataclass(frozen=True)
class ConvertOptions:
    """What to produce.  Parallel flags apply to a Neuron target (and to reading an NxD tag: ``hw``)."""

    to: Literal["cuda", "neuron"]
    format: Format = "ckpt"
    from_: Literal["cuda", "neuron"] | None = None
    tp: int = 1
    pp: int = 1
    dp: int = 1
    virtual_pp: int = 1
    kv_size_multiplier: int = 1
    hw: str = "trn1"
    fuse_qkv: bool = False
    qkv_linear: bool = False
    config: dict[str, Any] | None = None
    step: int | None = None
    workers: int = 1
    flush_bytes: int = DEFAULT_FLUSH_BYTES
    max_shard_bytes: int = 5 << 30
    storage_options: dict[str, Any] | None = field(default=None, hash=False)


def load_config(path: str | None) -> dict[str, Any] | None:
    """An HF ``config.json`` as a dict (one-line error when unreadable)."""
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CkptError(f"--config {path}: no such file") from None
    except ValueError as e:
        raise CkptError(f"--config {path}: not valid JSON ({e})") from None


def detect_format(src: str) -> str:
    """``ckpt`` / ``dcp`` / ``hf`` / ``nxd`` for the folder at ``src`` (one-line error when none fits)."""
    if "://" not in src and not Path(src).exists():
        raise CkptError(f"{src}: no such file or directory")
    if open_storage(src).exists(MANIFEST_NAME):
        return "ckpt"
    if "://" in src:
        raise CkptError(f"{src}: no manifest.json; only our format is read from object stores")
    if is_dcp_dir(src):
        return "dcp"
    if is_hf_dir(src):
        return "hf"
    if is_nxd_dir(src):
        return "nxd"
    raise LayoutError(
        f"{src}: unknown checkpoint layout (expected manifest.json, a DCP .metadata, an HF config.json + "
        "*.safetensors, or NxD model/ rank files)"
    )


def open_source(src: str, opts: ConvertOptions) -> Source:
    """Open ``src`` in whatever format it is in, and check it has the layout ``--from`` says."""
    fmt = detect_format(src)
    step = opts.step or 0
    if fmt == "ckpt":
        source: Source = ManifestSource(src, config=opts.config, storage_options=opts.storage_options)
    elif fmt == "dcp":
        source = open_dcp(src, config=opts.config, step=step)
    elif fmt == "hf":
        source = open_hf(src, config=opts.config, step=step)
    else:
        source = open_nxd(src, config=opts.config, hw=opts.hw)
    if opts.from_ is not None and opts.from_ != source.layout:
        raise LayoutError(f"{src} is a {source.layout}-layout {fmt} checkpoint; pass --from {source.layout}")
    if opts.step is not None:
        source.trees.step = opts.step
        source.trees.progress["step"] = opts.step
    return source


def target_spec(source: Source, opts: ConvertOptions) -> LayoutSpec:
    """The Neuron layout requested, validated against the model config (one-line ``LayoutError``)."""
    cfg = opts.config if opts.config is not None else source.config
    if not cfg:
        raise LayoutError(f"{source.path}: the model config is unknown; pass --config config.json")
    return LayoutSpec.from_hf_config(
        cfg,
        tp=opts.tp,
        pp=opts.pp,
        dp=opts.dp,
        virtual_pp=opts.virtual_pp,
        kv_size_multiplier=opts.kv_size_multiplier,
        hw=opts.hw,  # type: ignore[arg-type]
        fuse_qkv=opts.fuse_qkv,
        qkv_linear=opts.qkv_linear,
    )


def plan_conversion(source: Source, opts: ConvertOptions) -> Conversion:
    """Plan and check the whole conversion; nothing is written."""
    if opts.to == "cuda":
        if opts.format == "nxd":
            raise LayoutError("--format nxd writes the Neuron layout; use --to neuron")
        conv = plan_to_cuda(source, config=opts.config)
        if opts.format == "hf":
            check_hf_export(conv)
        elif opts.format == "dcp":
            check_dcp_export(conv)
    elif opts.to == "neuron":
        if opts.format in ("hf", "dcp"):
            raise LayoutError(
                f"--format {opts.format} holds the CUDA layout; use --to cuda or --format ckpt|nxd"
            )
        conv = plan_to_neuron(source, target_spec(source, opts), config=opts.config)
    else:
        raise LayoutError(f"--to {opts.to!r} must be cuda or neuron")
    if opts.workers < 1:
        raise CkptError(f"--workers {opts.workers} must be >= 1")
    return conv


def describe(conv: Conversion, opts: ConvertOptions) -> dict[str, Any]:
    """The dry-run report: what would be written and the estimated peak memory of one worker."""
    roles: dict[str, int] = {}
    for t in conv.tensors:
        roles[t.info.role] = roles.get(t.info.role, 0) + 1
    return {
        "source": {
            "path": conv.view.source.path,
            "format": conv.view.source.format,
            "layout": conv.view.source.layout,
        },
        "target": {"layout": conv.to, "format": opts.format, "spec": _spec_text(conv.spec)},
        "tensors": len(conv.tensors),
        "by_role": roles,
        "bytes": conv.nbytes,
        "largest_tensor": max((t.info.nbytes for t in conv.tensors), default=0),
        "peak_memory_estimate": conv.peak_bytes_estimate(
            2 * opts.flush_bytes if opts.format == "ckpt" else 0
        ),
        "step": conv.trees.step,
        "workers": opts.workers,
    }


def _spec_text(spec: LayoutSpec | None) -> str | None:
    if spec is None:
        return None
    return (
        f"tp={spec.tp} pp={spec.pp} vpp={spec.virtual_pp} dp={spec.dp} kv_size_multiplier={spec.kv_size_multiplier} "
        f"hw={spec.hw} fuse_qkv={spec.fuse_qkv} qkv_linear={spec.qkv_linear}"
    )


@dataclass(frozen=True)
class ConvertResult:
    dst: str
    tensors: int
    bytes: int
    format: str


def _dist_env() -> tuple[int, int]:
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def _check_ckpt_dst(dst: str, opts: ConvertOptions) -> None:
    storage = open_storage(dst, opts.storage_options)
    if storage.exists(MANIFEST_NAME):
        raise CheckpointExistsError(f"{storage.display(MANIFEST_NAME)} already exists; choose a new DST")


def _same_path(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return Path(a).resolve() == Path(b).resolve()


def _worker(src: str, dst: str, opts: ConvertOptions, index: int, n: int, attempt: str) -> Receipt:
    """One local worker process: re-open and re-plan (deterministic), write share ``index`` of ``n``."""
    import torch

    torch.set_num_threads(1)
    source = open_source(src, opts)
    conv = plan_conversion(source, opts)
    share = assign_shares(conv.tensors, n)[index]
    writer = StreamingWriter(
        dst, rank=index, attempt=attempt, flush_bytes=opts.flush_bytes, storage_options=opts.storage_options
    )
    try:
        return write_share(conv, writer, share)
    except BaseException:
        writer.abort()
        raise


def convert(
    src: str,
    dst: str,
    opts: ConvertOptions,
    *,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[Conversion], None] | None = None,
) -> ConvertResult:
    """Convert ``src`` into ``dst`` as ``opts`` says.  Checks first, writes second, commits last."""
    if _same_path(src, dst):
        raise CkptError("SRC and DST are the same path; SRC is never written")
    rank, world = _dist_env()
    source = open_source(src, opts)
    conv = plan_conversion(source, opts)
    if opts.format == "ckpt":
        _check_ckpt_dst(dst, opts)
    else:
        from .fsutil import check_dst_free

        check_dst_free(dst)
    if on_plan is not None:
        on_plan(conv)
    result = ConvertResult(dst, len(conv.tensors), conv.nbytes, opts.format)
    if opts.format != "ckpt":
        export = folder_export(conv, opts)
        if world > 1:
            _export_distributed(export, dst, rank, world, progress)
        elif opts.workers > 1:
            _export_local_workers(export, src, dst, opts, progress)
        else:
            write_serial(export, dst, progress)
    elif world > 1:
        _convert_distributed(conv, dst, opts, rank, world, progress)
    elif opts.workers > 1:
        _convert_local_workers(conv, src, dst, opts, progress)
    else:
        writer = StreamingWriter(dst, flush_bytes=opts.flush_bytes, storage_options=opts.storage_options)
        try:
            receipt = write_share(conv, writer, None, progress)
            commit(conv, writer.storage, [receipt])
        except BaseException:
            writer.abort()
            raise
    source.close()
    return result


def _sweep(dst: str, opts: ConvertOptions, attempt: str) -> None:
    """Remove data files of a failed attempt (their names carry the attempt id)."""
    storage = open_storage(dst, opts.storage_options)
    try:
        names = storage.listdir()
    except Exception:  # noqa: BLE001
        return
    for name in names:
        if f"-{attempt}-" in name:
            storage.delete(name)


def _convert_local_workers(
    conv: Conversion, src: str, dst: str, opts: ConvertOptions, progress: Callable[[int], None] | None
) -> None:
    from concurrent.futures import as_completed

    attempt = uuid.uuid4().hex[:8]
    n = opts.workers
    shares = assign_shares(conv.tensors, n)
    receipts: list[Receipt] = []
    try:
        with worker_pool(n) as pool:
            futures = {submit(pool, _worker, src, dst, opts, i, n, attempt): i for i in range(n)}
            for fut in as_completed(futures):
                receipts.append(fut.result())
                if progress is not None:
                    progress(sum(conv.tensors[j].info.nbytes for j in shares[futures[fut]]))
        commit(conv, open_storage(dst, opts.storage_options), sorted(receipts, key=lambda r: r.rank))
    except BaseException:
        _sweep(dst, opts, attempt)
        raise


def _convert_distributed(
    conv: Conversion,
    dst: str,
    opts: ConvertOptions,
    rank: int,
    world: int,
    progress: Callable[[int], None] | None,
) -> None:
    """torchrun: every rank writes its share; rank 0 gathers receipts and commits; everyone learns the outcome."""
    import torch.distributed as dist

    own = False
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        own = True
    try:
        attempt = [uuid.uuid4().hex[:8] if rank == 0 else None]
        dist.broadcast_object_list(attempt, src=0)
        share = assign_shares(conv.tensors, world)[rank]
        writer = StreamingWriter(
            dst,
            rank=rank,
            attempt=attempt[0],
            flush_bytes=opts.flush_bytes,
            storage_options=opts.storage_options,
        )
        failure = _write_gather_commit(
            rank,
            world,
            lambda: write_share(conv, writer, share, progress),
            lambda receipts: commit(conv, open_storage(dst, opts.storage_options), receipts),
        )
        if failure:
            writer.abort()
            raise CkptError(f"conversion failed, nothing committed: {failure}")
    finally:
        if own:
            dist.destroy_process_group()


# ------------------------------------------------------------------------------ HF / DCP / NxD folders


def folder_export(conv: Conversion, opts: ConvertOptions) -> FolderExport:
    """The :class:`~.parallel.FolderExport` of ``opts.format`` (hf, dcp, nxd) over plan ``conv``."""
    if opts.format == "hf":
        return HFExport(conv, max_shard_bytes=opts.max_shard_bytes)
    if opts.format == "dcp":
        return DcpExport(conv)
    if opts.format == "nxd":
        return NxdExport(conv)
    raise CkptError(f"--format {opts.format} is not a folder format")


def _folder_worker(src: str, opts: ConvertOptions, tmp: str, index: int, n: int) -> UnitReceipt:
    """One local worker process: re-open and re-plan (deterministic), write share ``index`` of ``n`` into ``tmp``.

    Re-planning instead of shipping the plan keeps the parent's pickling out of the way and is what a torchrun
    rank does anyway; :func:`~.parallel.check_cover` at commit catches a worker that planned differently.
    """
    import torch

    torch.set_num_threads(1)
    source = open_source(src, opts)
    try:
        export = folder_export(plan_conversion(source, opts), opts)
        return export.write(Path(tmp), balance(export.weights, n)[index], None, worker=index)
    finally:
        source.close()


def _export_local_workers(
    export: FolderExport,
    src: str,
    dst: str,
    opts: ConvertOptions,
    progress: Callable[[int], None] | None,
) -> None:
    """``--workers N``: the parent makes the temp folder, N spawned processes fill it, the parent commits.

    On any failure the parent waits for the other workers (leaving the pool's ``with`` block), then removes the
    temp folder with everything in it: nothing is ever renamed to ``dst``.
    """
    from concurrent.futures import as_completed

    n = opts.workers
    shares = balance(export.weights, n)
    tmp = export.begin(Path(dst))
    try:
        receipts: list[UnitReceipt] = []
        busy = [i for i in range(n) if shares[i]]  # more workers than units: the rest have nothing to do
        with worker_pool(max(1, len(busy))) as pool:
            futures = {submit(pool, _folder_worker, src, opts, str(tmp), i, n): i for i in busy}
            for fut in as_completed(futures):
                receipts.append(fut.result())
                if progress is not None:
                    progress(sum(export.weights[u] for u in shares[futures[fut]]))
        export.commit(tmp, Path(dst), receipts)
    except BaseException:
        export.abort(tmp)
        raise


def _export_distributed(
    export: FolderExport,
    dst: str,
    rank: int,
    world: int,
    progress: Callable[[int], None] | None,
) -> None:
    """torchrun: rank 0 makes the temp folder and broadcasts its path, every rank writes its share of whole files
    into it, rank 0 gathers the receipts and commits (or removes the folder), and every rank learns the outcome.

    Ranks on several machines need DST's parent on a filesystem they all share (the temp folder is next to DST).
    """
    import torch.distributed as dist

    own = False
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        own = True
    tmp: Path | None = None
    try:
        begun: list[Any] = [None]
        begin_error: Exception | None = None
        if rank == 0:
            try:
                tmp = export.begin(Path(dst))
                begun[0] = ("ok", str(tmp))
            except Exception as e:  # noqa: BLE001 - every rank must learn it, or they wait forever
                begin_error = e
                begun[0] = ("error", f"{e}")
        dist.broadcast_object_list(begun, src=0)
        if begin_error is not None:
            raise begin_error  # rank 0: the original one-line error (e.g. DST exists)
        if begun[0][0] == "error":
            raise CkptError(f"conversion failed, nothing committed: rank 0: {begun[0][1]}")
        path = Path(begun[0][1])
        share = balance(export.weights, world)[rank]
        failure = _write_gather_commit(
            rank,
            world,
            lambda: export.write(path, share, progress, worker=rank),
            lambda receipts: export.commit(path, Path(dst), receipts),
        )
        if rank == 0:
            if failure:
                export.abort(path)
            tmp = None
        if failure:
            raise CkptError(f"conversion failed, nothing committed: {failure}")
    finally:
        if tmp is not None:  # rank 0 left early (a collective failed): the folder is not published
            export.abort(tmp)
        if own:
            dist.destroy_process_group()


def _write_gather_commit(
    rank: int, world: int, write: Callable[[], Any], commit_all: Callable[[list[Any]], None]
) -> str | None:
    """Every rank runs ``write``; rank 0 gathers the receipts and runs ``commit_all`` iff no rank failed.

    Returns the failure text (the same on every rank), or None when committed.  Errors are gathered, not raised
    locally, so that no rank is left waiting in a collective.
    """
    import torch.distributed as dist

    receipt, error = None, None
    try:
        receipt = write()
    except Exception as e:  # noqa: BLE001 - reported to rank 0, then raised everywhere
        error = f"rank {rank}: {e}"
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object((receipt, error), gathered if rank == 0 else None, dst=0)
    outcome: list[Any] = [None]
    if rank == 0:
        errors = [e for _, e in gathered if e]
        if not errors:
            try:
                commit_all([r for r, _ in gathered])
            except Exception as e:  # noqa: BLE001
                errors.append(f"commit: {e}")
        outcome[0] = "; ".join(errors) or None
    dist.broadcast_object_list(outcome, src=0)
    return outcome[0]


__all__ = [
    "ConvertOptions",
    "folder_export",
    "ConvertResult",
    "convert",
    "describe",
    "detect_format",
    "load_config",
    "open_source",
    "plan_conversion",
]
