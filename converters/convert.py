"""``convert``: detect the source format, plan, check everything, then write the target and commit it last.

Every impossible request raises a one-line ``CkptError`` from :func:`plan_conversion`, before any byte is written.
SRC is only ever read.  The formats are the table in :mod:`.formats`; the engine (:mod:`.engine`) plans and runs.

Parallelism: ``RunOptions(workers=N)`` runs N local processes, each writing a disjoint, byte-balanced share of the
output's units; under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) each rank writes its share and rank 0 commits, so
many machines can convert one checkpoint together (:mod:`.engine.run`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt.errors import CheckpointExistsError, CkptError, LayoutError
from ckpt.layouts.spec import NxdFlags
from ckpt.storage import refusal

from . import formats
from .engine import (
    Conversion,
    Export,
    Source,
    plan_to_cuda,
    plan_to_neuron,
    run_serial,
    run_torchrun,
    run_workers,
)
from .engine.memory import estimate
from .engine.run import RunReport
from .options import ConvertOptions, RunOptions, load_config

_LAYOUT_NAMES = {"cuda": "CUDA", "neuron": "Neuron"}


def open_source(src: str | formats.Detected, opts: ConvertOptions, run: RunOptions | None = None) -> Source:
    """Open ``src`` (a path, or what :func:`formats.detect_source` found there) in whatever format it is in, and
    check it has the layout ``--from`` says."""
    run = run or RunOptions()
    found = src if isinstance(src, formats.Detected) else formats.detect_source(src, run.storage_options)
    src, fmt = found.path, found.format
    if opts.param_names is not None and not fmt.nxd_tag:
        raise LayoutError(
            f"param_names: {src} is a {fmt.name} checkpoint; optimizer pid names are for NxD tags only"
        )
    if opts.source_flags and not fmt.nxd_tag:
        flag = next(iter(opts.source_flags))
        raise LayoutError(
            f"--source-{flag.replace('_', '-')}: {src} is a {fmt.name} checkpoint, which records its own layout; "
            "source flags are for NxD tags only"
        )
    source: Source = fmt.load().open_source(src, **_source_options(found, opts, run))
    if opts.model_type is not None and source.config is not None:
        have = source.config.get("model_type")
        if have is not None and have != opts.model_type:
            source.close()
            raise LayoutError(
                f"--model-type {opts.model_type} contradicts {src}'s config model_type {have!r}"
            )
        source.config = {**source.config, "model_type": opts.model_type}
    if opts.replicated and source.record is not None:
        merged = tuple(dict.fromkeys((*source.record.replicated, *opts.replicated)))
        source.record = dataclasses.replace(source.record, replicated=merged)
    if opts.from_ is not None and opts.from_ != source.layout:
        source.close()
        raise LayoutError(
            f"{src} is a {source.layout}-layout {fmt.name} checkpoint; pass --from {source.layout}"
        )
    if opts.step is not None:
        source.trees.step = opts.step
        source.trees.progress["step"] = opts.step
    if opts.consumed_samples is not None:
        _record_consumed_samples(source, opts.consumed_samples)
    return source


def _source_options(found: formats.Detected, opts: ConvertOptions, run: RunOptions) -> dict[str, Any]:
    """The keywords every format's ``open_source`` verb is given (each takes what it uses)."""
    options = {"replicated": tuple(opts.replicated), "target_format": opts.format}
    for name in ("config", "source_flags", "step", "param_names"):
        options[name] = getattr(opts, name)
    for name in ("storage_options", "verify", "allow_unmarked"):
        options[name] = getattr(run, name)
    if found.manifest is not None:
        options["manifest"] = found.manifest
    return options


def _record_consumed_samples(source: Source, samples: int) -> None:
    """``--consumed-samples``: the data position of a SRC that records none; one that records another is refused."""
    from .nxd.training import consumed_samples, data_position

    have = consumed_samples(source.trees.data_position)
    if source.trees.data_position is not None and have != samples:
        source.close()
        raise LayoutError(
            f"--consumed-samples {samples}: {source.path} records "
            f"{'a data position without a sample count' if have is None else f'{have} consumed samples'}; drop it"
        )
    if source.trees.data_position is None:
        source.trees.data_position = data_position(samples, source.trees.step, 0, 1, "consumed_samples")
        source.trees.progress["samples"] = samples


def step_unknown(conv: Conversion, opts: ConvertOptions) -> bool:
    """SRC's files record no training step and ``--step`` was not given."""
    return opts.step is None and not conv.source.step_recorded


def warn_unrecorded_step(conv: Conversion, opts: ConvertOptions) -> None:
    """Say which step the output gets when SRC records none and ``--step`` was not given, for output formats that
    record one (after planning, so a refused request is one error line and nothing else)."""
    result = formats.get(opts.format).step_note
    if not step_unknown(conv, opts) or result is None:
        return
    warnings.warn(
        f"{conv.source.path}: SRC records no training step; {result} (pass --step N to set it)", stacklevel=3
    )


#: the flags a CUDA checkpoint converted from NxD recorded (``extra.converted_from.nxd``) and a way back reuses;
#: the sizes (tp, pp, dp) are the caller's choice, and ``virtual_pp`` only means something with the old ``pp``
_ROUND_TRIP_FLAGS = ("qkv_linear", "fuse_qkv", "kv_size_multiplier", "hw")


def recorded_flags(source: Source) -> dict[str, Any]:
    """The Neuron naming flags a CUDA-layout source recorded when it was converted from NxD (else empty)."""
    came = source.trees.extra.get("converted_from") if isinstance(source.trees.extra, dict) else None
    nxd = came.get("nxd") if isinstance(came, dict) and came.get("layout") == "neuron" else None
    if not isinstance(nxd, dict):
        return {}
    return {k: nxd[k] for k in _ROUND_TRIP_FLAGS if k in nxd}


def kept_round_trip_flags(source: Source, opts: ConvertOptions) -> dict[str, Any]:
    """The recorded flags a CUDA source's way back keeps (not given by the caller, not NxD's defaults)."""
    if source.layout == "neuron":
        return {}
    base = dataclasses.asdict(NxdFlags())
    return {k: v for k, v in recorded_flags(source).items() if k not in opts.layout and base[k] != v}


def _say_round_trip(source: Source, opts: ConvertOptions) -> None:
    kept = kept_round_trip_flags(source, opts)
    if kept:
        shown = ", ".join(f"{k}={v}" for k, v in kept.items())
        warnings.warn(
            f"{source.path}: keeping the Neuron layout it was converted from ({shown}, "
            "extra.converted_from.nxd); pass the flags (e.g. --no-qkv-linear) to choose another",
            stacklevel=3,
        )


def target_flags(source: Source, opts: ConvertOptions) -> NxdFlags:
    """The Neuron layout asked for: the flags given, the rest from the source's own Neuron layout, else from the
    layout a CUDA source was converted from (so a round trip keeps ``qkv_proj.weight_q|k|v`` names), else defaults.
    """
    if source.layout == "neuron" and source.flags is not None:
        base = dataclasses.asdict(source.flags)
    else:
        base = dataclasses.asdict(NxdFlags())
        base.update(kept_round_trip_flags(source, opts))
    try:
        return NxdFlags(**{**base, **opts.layout})
    except TypeError as e:
        raise LayoutError(f"layout flags: {e}") from None


def plan_conversion(source: Source, opts: ConvertOptions) -> Conversion:
    """Plan and check the whole conversion; nothing is written."""
    fmt = formats.get(opts.format)
    if opts.to not in fmt.holds:
        raise LayoutError(
            f"--format {fmt.name} holds the {' or '.join(_LAYOUT_NAMES[h] for h in fmt.holds)} layout; "
            f"use --to {fmt.holds[0]} "
            f"or --format {'|'.join(f.name for f in formats.FORMATS if f.suggested and opts.to in f.holds)}"
        )
    if opts.to == "cuda":
        if opts.layout:
            flag = next(iter(opts.layout))
            raise LayoutError(
                f"--{flag.replace('_', '-')} describes a Neuron target and does nothing with --to cuda"
                + (
                    "; for an NxD tag source use --source-" + flag.replace("_", "-")
                    if flag in ("hw", "kv_size_multiplier", "virtual_pp")
                    else ""
                )
            )
        return plan_to_cuda(source, config=opts.config)
    flags = target_flags(source, opts)
    if fmt.fits_layout:
        config = opts.config if opts.config is not None else source.config
        flags = fmt.load().fit_flags(flags, opts.layout, config)
    conv = plan_to_neuron(source, flags, config=opts.config, replicated=tuple(opts.replicated))
    if _dist_env()[0] == 0:
        _say_round_trip(source, opts)  # after planning: a refused request stays one error line
    return conv


def make_export(conv: Conversion, opts: ConvertOptions, run: RunOptions) -> Export:
    """The :class:`~.engine.Export` of ``opts.format`` over plan ``conv`` (each format takes the keywords it uses)."""
    options = {"flush_bytes": run.flush_bytes, "storage_options": run.storage_options, "verify": run.verify}
    for name in ("codec", "max_shard_bytes", "xser", "zero1"):
        options[name] = getattr(opts, name)
    return formats.get(opts.format).load().export(conv, **options)


def describe(conv: Conversion, opts: ConvertOptions, run: RunOptions | None = None) -> dict[str, Any]:
    """The dry-run report: what would be written and the estimated peak memory of one worker (anonymous memory on
    top of the interpreter, from the plan and the export that would run it: :mod:`.engine.memory`)."""
    run = run or RunOptions()
    export = make_export(conv, opts, run)  # plans only; nothing is written before begin()
    written = written_tensors(conv, export)
    warn_unrecorded_step(conv, opts)
    mem = estimate(conv, export)
    roles: dict[str, int] = {}
    for t in written:
        roles[t.desc.role] = roles.get(t.desc.role, 0) + 1
    return {
        "source": {"path": conv.source.path, "format": conv.source.format, "layout": conv.source.layout},
        "target": {"layout": conv.to, "format": opts.format, "spec": _flags_text(conv.flags)},
        "tensors": len(written),
        "by_role": roles,
        "bytes": sum(t.desc.nbytes for t in written),
        "not_written": list(getattr(export, "not_written", ())),
        "largest_tensor": max((t.desc.nbytes for t in written), default=0),
        "peak_memory_estimate": mem.total,
        "peak_memory": {"part": mem.part, "source_cache": mem.source, "target": mem.export},
        "step": None if step_unknown(conv, opts) else conv.trees.step,
        "workers": run.workers,
    }


def _flags_text(flags: NxdFlags | None) -> str | None:
    if flags is None:
        return None
    return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(flags).items())


@dataclass(frozen=True)
class ConvertResult:
    """What was written: ``tensors`` / ``bytes`` count what DST holds (a format may hold less than the plan,
    e.g. an HF folder holds no optimizer state); ``not_written`` lists what was left out, ``why`` says why."""

    dst: str
    tensors: int
    bytes: int
    format: str
    not_written: tuple[str, ...] = ()
    why: str | None = None
    #: summary lines the CLI prints after the result line (e.g. how a LoRA adapter was widened for NxD)
    notes: tuple[str, ...] = ()
    #: per rank (torchrun: every rank's, on rank 0; one process: its own): ``{rank, bytes_read, bytes_written,
    #: seconds}`` (engine/meter.py says what is counted)
    ranks: tuple[dict[str, Any], ...] = ()
    #: the rank this process ran as (0 outside torchrun): only rank 0 reports
    rank: int = 0


def written_tensors(conv: Conversion, export: Export) -> list[Any]:
    """The planned tensors ``export`` writes (all of them unless the format keeps a subset: ``export.kept``)."""
    kept = getattr(export, "kept", None)
    return list(conv.tensors) if kept is None else [t for t in conv.tensors if t.desc.name in set(kept)]


def _dist_env() -> tuple[int, int]:
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def _local(p: str) -> Path | None:
    if "://" in p and not p.startswith("file://"):
        return None
    return Path(p.removeprefix("file://")).resolve()


def check_paths(src: str, dst: str, storage_options: dict[str, Any] | None = None) -> None:
    """SRC is never written: DST may be neither SRC, nor inside it, nor above it, nor any used folder; neither is a
    mangled URL (``s3:/b/x``).  The same checks, and messages, for every output format, before any work."""
    from ckpt.storage import refuse_mangled_url

    refuse_mangled_url(src)
    refuse_mangled_url(dst)
    a, b = _local(src), _local(dst)
    if a is None or b is None:
        if src.rstrip("/") == dst.rstrip("/") or dst.startswith(src.rstrip("/") + "/"):
            raise CkptError(f"DST {dst} is inside SRC {src}; SRC is never written, choose a DST outside it")
        if b is None:
            refuse_used_dst(dst, src, storage_options=storage_options)
        return
    if a == b:
        raise CkptError("SRC and DST are the same path; SRC is never written")
    if a in b.parents:
        raise CkptError(f"DST {dst} is inside SRC {src}; SRC is never written, choose a DST outside it")
    check_writable_dst(dst, b)
    refuse_used_dst(dst, src, local=b, src_path=a)


def refuse_used_dst(
    dst: str,
    src: str,
    *,
    local: Path | None = None,
    src_path: Path | None = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """DST must be a new (or empty) folder: one that holds anything, SRC above all, is refused with one message
    whatever the output format (a converted checkpoint would land beside, or over, what the folder holds)."""
    if local is not None:
        used = local.is_dir() and any(local.iterdir())
        holds_src = src_path is not None and local in src_path.parents
    else:
        from ckpt.storage import open_storage

        used = bool(open_storage(dst, storage_options).listdir())
        holds_src = src.startswith(dst.rstrip("/") + "/")
    if used or holds_src:
        what = f"it holds SRC {src}" if holds_src else "it is not empty"
        raise CheckpointExistsError(
            f"DST {dst} already exists and {what}; DST must be a new or empty folder, choose another"
        )


def check_writable_dst(dst: str, path: Path) -> None:
    """A local DST must be a folder-to-be: not an existing file, under a writable folder (checked before any work)."""
    if path.exists() and not path.is_dir():
        raise CkptError(f"DST {dst} is an existing file; DST is a folder to create, choose another path")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CkptError(f"DST {dst}: {parent} is a file, not a folder; choose a DST under a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if os.statvfs(parent).f_flag & os.ST_RDONLY else "is not writable by this user"
        raise CkptError(f"DST {dst}: {parent} {why}; choose a writable location")


def _new_dirs(dst: str) -> list[Path]:
    """The local folders that writing ``dst`` would create (``dst`` first, then its missing parents)."""
    p = _local(dst)
    made: list[Path] = []
    while p is not None and not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    return made


@contextmanager
def _no_trace(dst: str) -> Iterator[None]:
    """On any failure (Ctrl-C included) remove the folders the conversion created for ``dst``, once the export
    has removed its files: a DST that did not exist before does not remain, not even empty."""
    made = _new_dirs(dst)
    try:
        yield
    except BaseException:
        for d in made:  # deepest first; a folder something else wrote into meanwhile stays
            try:
                if d.is_dir():
                    d.rmdir()
            except OSError:
                break
        raise


def _rebuild(found: formats.Detected, opts: ConvertOptions, run: RunOptions) -> Export:
    """In a worker process: re-open and re-plan (deterministic) and return the same export."""
    source = open_source(found, opts, run)
    export = make_export(plan_conversion(source, opts), opts, run)
    export.close = source.close  # type: ignore[attr-defined]  # released by the worker driver
    return export


def prepare(
    src: str, opts: ConvertOptions, run: RunOptions, *, adapters: formats.Detected | None = None
) -> tuple[formats.Detected, ConvertOptions]:
    """Detect SRC, once for the whole conversion, and put the Neuron flags given without a side on the side that
    is Neuron (:meth:`ConvertOptions.sided`).  ``adapters``: the adapter pass, when already run."""
    found = adapters if adapters is not None else formats.detect_adapter(src, run.storage_options)
    if not converts_whole(found, opts):
        found = formats.detect_source(src, run.storage_options, adapters=found)
    return found, opts.sided(found.format.nxd_tag)


def converts_whole(found: formats.Detected, opts: ConvertOptions) -> bool:
    """A conversion the table's adapter entry runs whole (a LoRA adapter read, written or merged), not the engine."""
    return found.adapter or opts.merge_lora is not None or formats.get(opts.format).whole


def convert(
    src: str,
    dst: str,
    opts: ConvertOptions,
    run: RunOptions | None = None,
    *,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> ConvertResult:
    """Convert ``src`` into ``dst`` as ``opts`` says.  Checks first, writes second, commits last.

    ``on_plan(nbytes)`` is called once planned, with the bytes of tensor data that will be written (a progress
    bar's total).  What the target format cannot hold is named in a warning and in the result, never dropped
    silently.
    """
    run = run or RunOptions()
    check_paths(src, dst, run.storage_options)
    found, opts = prepare(src, opts, run)
    if converts_whole(found, opts):
        if run.workers > 1 or _dist_env()[1] > 1:
            raise CkptError("LoRA adapters convert in one process; drop --workers / torchrun")
        if opts.consumed_samples is not None:
            raise CkptError("--consumed-samples: a LoRA adapter conversion records no data position; drop it")
        with _no_trace(dst), refusal.reported(dst, f"the --format {opts.format} output"):
            r = formats.ADAPTER.load().convert(found, dst, opts, run)
        return ConvertResult(r.dst, r.tensors, r.bytes, r.format, notes=r.notes)
    rank, world = _dist_env()
    report = RunReport()
    source = open_source(found, opts, run)
    try:
        conv = plan_conversion(source, opts)
        export = make_export(conv, opts, run)
        written = written_tensors(conv, export)
        if rank == 0:
            warn_unrecorded_step(conv, opts)
        left = tuple(getattr(export, "not_written", ()))
        why = getattr(formats.get(opts.format).load(), "NOT_WRITTEN_WHY", None)
        if left and rank == 0:
            warnings.warn(f"not written to {dst}: {', '.join(left)} ({why})", stacklevel=2)
        if opts.format == "nxd" and opts.step is not None and conv.trees.user is None and rank == 0:
            warnings.warn(
                f"--step {opts.step}: an NxD tag keeps its step only in user_content.pt, which SRC has no content "
                "for; DST records no step",
                stacklevel=2,
            )
        if on_plan is not None:
            on_plan(sum(t.desc.nbytes for t in written))
        what = f"the --format {opts.format} output"
        with _no_trace(dst) if rank == 0 else nullcontext(), refusal.reported(dst, what):
            if world > 1:
                run_torchrun(export, dst, rank, world, progress, report)
            elif run.workers > 1:
                run_workers(export, dst, run.workers, functools.partial(_rebuild, found, opts, run), progress)
            else:
                run_serial(export, dst, progress, report)
    finally:
        source.close()
    return ConvertResult(
        dst, len(written), sum(t.desc.nbytes for t in written), opts.format, left, why if left else None,
        ranks=tuple(s.as_dict() for s in report.ranks), rank=rank,
    )  # fmt: skip


__all__ = [
    "ConvertOptions",
    "ConvertResult",
    "RunOptions",
    "check_paths",
    "converts_whole",
    "refuse_used_dst",
    "convert",
    "describe",
    "load_config",
    "make_export",
    "open_source",
    "plan_conversion",
    "prepare",
    "target_flags",
]
