"""``convert``: detect the source format, plan, check everything, then write the target atomically.

Formats (one module each, same verbs ``open_*`` / ``write_*``): our manifest (``ckpt_layout``), Hugging Face
(``hf``), torch DCP (``dcp``), NxD-native tags (``nxd_tag``).  Every impossible request raises a one-line
``CkptError`` from :func:`plan_conversion`, before any byte is written.  SRC is only ever read.

Parallelism (our manifest format): ``workers=N`` runs N local processes, each converting a disjoint,
byte-balanced share of the target tensors into its own data files; the parent commits the manifest from their
receipts.  Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) each rank converts its share and rank 0 commits after
gathering the receipts over a gloo group, so many machines can convert one checkpoint together.
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
from ckpt.storage import Storage
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
from .dcp import check_dcp_export, is_dcp_dir, open_dcp, write_dcp
from .hf import check_hf_export, is_hf_dir, open_hf, write_hf
from .nxd_tag import is_nxd_dir, open_nxd, write_nxd

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
    if Storage(src).exists(MANIFEST_NAME):
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
    if opts.workers > 1 and opts.format != "ckpt":
        raise CkptError(
            f"--workers {opts.workers} needs --format ckpt (hf/dcp/nxd are written by one process)"
        )
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
    storage = Storage(dst, opts.storage_options)
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
    if opts.format == "hf":
        write_hf(conv, dst, max_shard_bytes=opts.max_shard_bytes, progress=progress)
    elif opts.format == "dcp":
        write_dcp(conv, dst, progress=progress)
    elif opts.format == "nxd":
        write_nxd(conv, dst)
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
    storage = Storage(dst, opts.storage_options)
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
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    attempt = uuid.uuid4().hex[:8]
    n = opts.workers
    shares = assign_shares(conv.tensors, n)
    receipts: list[Receipt] = []
    try:
        with ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_worker, src, dst, opts, i, n, attempt): i for i in range(n)}
            for fut in as_completed(futures):
                receipts.append(fut.result())
                if progress is not None:
                    progress(sum(conv.tensors[j].info.nbytes for j in shares[futures[fut]]))
        commit(conv, Storage(dst, opts.storage_options), sorted(receipts, key=lambda r: r.rank))
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
        error: str | None = None
        receipt: Receipt | None = None
        try:
            receipt = write_share(conv, writer, share, progress)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, then raised everywhere
            error = f"rank {rank}: {e}"
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object((receipt, error), gathered if rank == 0 else None, dst=0)
        outcome: list[Any] = [None]
        if rank == 0:
            errors = [e for _, e in gathered if e]
            if not errors:
                try:
                    commit(conv, Storage(dst, opts.storage_options), [r for r, _ in gathered])
                except Exception as e:  # noqa: BLE001
                    errors.append(f"commit: {e}")
            outcome[0] = "; ".join(errors) or None
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0]:
            writer.abort()
            raise CkptError(f"conversion failed, nothing committed: {outcome[0]}")
    finally:
        if own:
            dist.destroy_process_group()


__all__ = [
    "ConvertOptions",
    "ConvertResult",
    "convert",
    "describe",
    "detect_format",
    "load_config",
    "open_source",
    "plan_conversion",
]
