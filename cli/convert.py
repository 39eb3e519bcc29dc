"""``ckpt convert SRC DST``: between Neuron (NxD TP/PP/ZeRO-1) and CUDA (full / FSDP / DCP / Hugging Face) layouts.

Thin: parses flags into :class:`ckpt.converters.convert.ConvertOptions`, shows a progress bar, prints the plan for
``--dry-run``.  Every impossible request fails before any work with one line and exit code 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from ckpt.converters import formats

from ckpt.errors import CkptError
from ckpt.layouts import families
from ckpt.words import count

from .common import err, human_bytes, out

#: the Neuron layout flags: one definition per flag, used for the target (``--tp``...) and, where an NxD tag cannot
#: record it, for the source (``--source-hw``...).  Unset flags keep the source's own Neuron layout (or defaults).
LAYOUT_FLAGS: dict[str, tuple[Any, str]] = {
    "tp": (int, "tensor-parallel size"),
    "pp": (int, "pipeline-parallel size"),
    "dp": (int, "data-parallel size (ZeRO-1 optimizer shards)"),
    "virtual_pp": (int, "virtual pipeline stages per rank"),
    "kv_size_multiplier": (int, "KV head replication"),
    "hw": (click.Choice(["trn1", "trn2"]), "KV head order of the hardware generation"),
    "fuse_qkv": (bool, "fused QKV weights"),
    "qkv_linear": (bool, "GQAQKVColumnParallelLinear names (qkv_proj.weight_q|k|v)"),
    "ep": (int, "expert-parallel size (MoE models: EP rank k holds the k-th contiguous block of experts)"),
}
#: what an NxD tag's files cannot say about it (the library's ``converters.options.SOURCE_FLAGS``): given without a
#: side, these describe whichever side is Neuron; ``--source-*`` / ``--target-*`` name the side where both are
SOURCE_FLAGS = ("hw", "kv_size_multiplier", "virtual_pp")

EPILOG = """\b
Examples:
  ckpt convert run/step_1000 out/cuda --to cuda --config config.json  # NxD tag (holds no config) -> CUDA layout
  ckpt convert run/step_1000 out/hf --to cuda --format hf --config config.json
  ckpt convert hf_model/ out/trn --to neuron --tp 16 --qkv-linear --kv-size-multiplier 2 --hw trn2  # 8 KV heads
  ckpt convert out/trn out/nxd_tag --to neuron --format nxd --dp 4    # NxD-native tag, ZeRO-1 over 4 ranks
  ckpt convert exp/checkpoints/llama--step=10-consumed_samples=1280.0.ckpt out/checkpoint-10 --to cuda \
      --format hf-trainer --config config.json                       # NxD Training tag -> HF Trainer folder
  ckpt convert out/checkpoint-10 exp/checkpoints/llama--step=10-consumed_samples=1280.0.ckpt --to neuron \
      --format nxdt --tp 8 --dp 4 --qkv-linear --consumed-samples 1280  # and back, as NxD Training names it
  ckpt convert big/ out/big --to cuda --workers 4 --dry-run
  ckpt convert peft_adapter/ out/lora_tag --to neuron --format nxd --tp 8 --qkv-linear --config base/config.json
  ckpt convert run/lora_step_500 out/peft --to cuda --format peft --config base/config.json
  ckpt convert run/lora_step_500 out/lora_ckpt --to cuda --format ckpt --config base/config.json --step 500
  ckpt convert base_hf/ out/merged --to cuda --format hf --merge-lora out/peft

\b
Layout flags describe the Neuron side: the target (unset ones keep SRC's own Neuron layout), or, with --to cuda,
an NxD tag SRC where its files cannot (--hw, --kv-size-multiplier, --virtual-pp). With both sides Neuron,
--source-*/--target-* say which side a flag describes where that is not clear. Exit codes: 0 converted, 1 SRC
damaged, 2 cannot run (bad input, unsupported SRC, impossible request).
"""


def layout_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The ``--tp`` ... ``--qkv-linear`` Neuron options and the sided ``--source-*`` / ``--target-*`` ones, from
    :data:`LAYOUT_FLAGS`."""
    for side, what in (("target", "Neuron target (where SRC is Neuron too)"), ("source", "NxD tag SRC")):
        for name in reversed(SOURCE_FLAGS):
            kind, text = LAYOUT_FLAGS[name]
            fn = click.option(f"--{side}-{name.replace('_', '-')}", f"{side}_{name}", type=kind, default=None,
                              help=f"{what}: its {text}.")(fn)  # fmt: skip
    for name, (kind, text) in reversed(LAYOUT_FLAGS.items()):
        flag = f"--{name.replace('_', '-')}"
        where = "Neuron side (the target; an NxD tag SRC with --to cuda)" if name in SOURCE_FLAGS else "Neuron target"
        if kind is bool:
            fn = click.option(
                f"{flag}/--no-{name.replace('_', '-')}", name, default=None, help=f"{where}: {text}."
            )(fn)
        else:
            fn = click.option(flag, name, type=kind, default=None, help=f"{where}: {text}.")(fn)
    return fn


def sided_flags(flags: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The layout options given, by side: ``layout`` (the target's), ``source_flags`` and ``neuron_flags`` (given
    without a side: the library puts them on the side that is Neuron)."""
    given = {k: v for k, v in flags.items() if v is not None}
    out: dict[str, dict[str, Any]] = {"layout": {}, "source_flags": {}, "neuron_flags": {}}
    for k, v in given.items():
        if k.startswith("source_"):
            out["source_flags"][k[len("source_") :]] = v
        elif k.startswith("target_"):
            out["layout"][k[len("target_") :]] = v
        else:
            out["neuron_flags" if k in SOURCE_FLAGS else "layout"][k] = v
    return out


def _format_help() -> str:
    return "Format of DST (" + "; ".join(f"{n}: {formats.get(n).help}" for n in formats.names()) + ")."


@click.command("convert", epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("src")
@click.argument("dst")
@click.option(
    "--from",
    "from_",
    type=click.Choice(["neuron", "cuda"]),
    default=None,
    help="Layout of SRC (checked; detected when omitted).",
)
@click.option("--to", "to", type=click.Choice(["neuron", "cuda"]), required=True, help="Layout of DST.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(formats.names()),
    default="ckpt",
    show_default=True,
    help=_format_help(),
)
@layout_options
@click.option(
    "--config", "config_path", type=str, default=None, help="Hugging Face config.json of the model."
)
@click.option(
    "--replicated",
    "replicated",
    multiple=True,
    metavar="GLOB",
    help="Neuron layouts: tensors the layout rules do not know (fnmatch glob over the whole name) that are "
    "replicated on every TP rank; repeatable. Any other unknown tensor is refused.",
)
@click.option(
    "--model-type",
    "model_type",
    type=str,
    default=None,
    help=f"HF model_type of a model whose config.json lacks one ({', '.join(families.FAMILIES)}); never guessed.",
)
@click.option(
    "--step",
    type=click.IntRange(min=0),
    default=None,
    help="Step to record (default: the source's; needed where SRC records none).",
)
@click.option(
    "--consumed-samples",
    "consumed_samples",
    type=click.IntRange(min=0),
    default=None,
    help="Samples the whole job consumed, recorded as the data position where SRC has none "
    "(--format nxdt names the tag by it).",
)
@click.option(
    "--merge-lora",
    "merge_lora",
    type=str,
    default=None,
    help="LoRA adapter (PEFT folder or NxD LoRA tag) to merge into SRC, the base HF model (--to cuda --format hf).",
)
@click.option(
    "--xser/--no-xser", default=None,
    help=f"--format {'/'.join(formats.owners('xser'))}: write torch_xla's xser form (default: SRC's; optimum-neuron: "
    "on).",
)
@click.option(
    "--codec",
    type=click.Choice(["raw", "zstd"]),
    default="raw",
    show_default=True,
    help=f"--format {'/'.join(formats.owners('codec'))}: data codec.",
)
@click.option("--allow-unmarked", is_flag=True, help="Use an NxD training tag whose save never wrote 'done'.")
@click.option(
    "--workers",
    type=int,
    default=1,
    show_default=True,
    help="Local worker processes, each writing a byte-balanced share of whole output files (all formats).",
)
@click.option(
    "--max-shard-size",
    "max_shard_size",
    type=str,
    default="5GiB",
    show_default=True,
    help=f"--format {'/'.join(formats.owners('max_shard_size'))}: largest shard file (bytes, or with KB/MB/GB/KiB/MiB/GiB); shards are what --workers share.",
)
@click.option(
    "--dry-run", is_flag=True, help="Print the plan (tensors, bytes, peak memory) and write nothing."
)
@click.option("--json", "as_json", is_flag=True, help="Print the result (or the --dry-run plan) as JSON.")
def convert(
    src: str,
    dst: str,
    from_: str | None,
    to: str,
    fmt: str,
    config_path: str | None,
    step: int | None,
    consumed_samples: int | None,
    merge_lora: str | None,
    xser: bool | None,
    codec: str,
    allow_unmarked: bool,
    workers: int,
    max_shard_size: str,
    dry_run: bool,
    as_json: bool,
    replicated: tuple[str, ...],
    model_type: str | None,
    **flags: Any,
) -> None:
    """Convert checkpoint SRC into DST (SRC is never written; DST is committed atomically)."""
    from ckpt.converters.convert import convert as run_convert
    from ckpt.converters.convert import converts_whole, describe, open_source, plan_conversion, prepare
    from ckpt.converters.options import ConvertOptions, RunOptions, load_config

    refuse_idle_flags(fmt)
    from ckpt.converters.engine.allocator import pin_malloc

    pin_malloc()  # freed buffers back to the OS: peak memory that does not creep up with the model
    opts = ConvertOptions(
        to=to,  # type: ignore[arg-type]
        format=fmt,
        from_=from_,  # type: ignore[arg-type]
        **sided_flags(flags),
        config=load_config(config_path),
        step=step,
        consumed_samples=consumed_samples,
        max_shard_bytes=parse_size(max_shard_size, "--max-shard-size"),
        xser=xser,
        codec=codec,
        replicated=replicated,
        model_type=model_type,
        merge_lora=merge_lora,
    )
    run = RunOptions(workers=workers, allow_unmarked=allow_unmarked)
    if not dry_run:
        _run(run_convert, src, dst, opts, run, as_json)
        return
    found = formats.detect_adapter(src)
    if converts_whole(found, opts):
        what = f"merge {merge_lora} into" if merge_lora else "adapter"
        out.print(
            f"plan: {what} {src} -> {fmt} ({to}) {dst}; adapters are checked whole when converted",
            markup=False,
        )
        return
    from ckpt.converters.convert import check_paths

    check_paths(src, dst)  # the plan of a conversion that would be refused is that refusal
    found, opts = prepare(src, opts, run, adapters=found)
    source = open_source(found, opts, run)
    try:
        d = describe(plan_conversion(source, opts), opts, run)
    finally:
        source.close()
    if as_json:
        import json

        click.echo(json.dumps({"dry_run": True, "dst": dst, **d}, indent=2))
        return
    out.print(
        f"plan: {d['source']['format']} ({d['source']['layout']}) {src} -> {fmt} ({to}) {dst}",
        markup=False,
    )
    if d["target"]["spec"]:
        out.print(f"  layout: {d['target']['spec']}")
    out.print(
        f"  tensors: {d['tensors']} ({', '.join(f'{k} {v}' for k, v in sorted(d['by_role'].items()))})"
    )
    out.print(f"  bytes: {human_bytes(d['bytes'])} ({d['bytes']})")
    if d["not_written"]:
        out.print(f"  not written: {', '.join(d['not_written'])}", markup=False)
    out.print(f"  largest tensor: {human_bytes(d['largest_tensor'])}")
    pm = d["peak_memory"]
    out.print(
        f"  peak memory estimate: {human_bytes(d['peak_memory_estimate'])} per worker, on top of the interpreter "
        f"(largest part {human_bytes(pm['part'])}, source cache {human_bytes(pm['source_cache'])}, "
        f"{fmt} target {human_bytes(pm['target'])})"
    )
    step_text = "unknown (SRC records none; pass --step N)" if d["step"] is None else d["step"]
    out.print(f"  step: {step_text}, workers: {workers}", markup=False)
    return


def refuse_idle_flags(fmt: str) -> None:
    """Refuse an option given on the command line that does nothing for ``--format fmt`` (never ignore it): the
    format-only options are the format table's."""
    ctx = click.get_current_context()
    params = {p.name: p for p in ctx.command.params}
    for name in formats.format_options():
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.COMMANDLINE:
            continue
        if name not in formats.get(fmt).options:
            flag = "/".join(params[name].opts + params[name].secondary_opts)
            raise CkptError(
                f"{flag} is for --format {'|'.join(formats.owners(name))} and does nothing with --format {fmt}; "
                "drop it"
            )


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
}


def parse_size(text: str, flag: str) -> int:
    """``"5GiB"`` / ``"500MB"`` / ``"1048576"`` as bytes (HF's ``max_shard_size`` spelling; one-line error)."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise CkptError(f"{flag} {text!r}: expected a size such as 2GB, 500MiB or 1048576")
    return int(float(m.group(1)) * _UNITS[unit])


def _run(run_convert, src: str, dst: str, opts, run, as_json: bool) -> None:  # noqa: ANN001 - internal
    """Convert with a progress bar; under torchrun only rank 0 shows it and the report (every rank's progress and
    numbers), another rank prints only an error of its own."""
    import os

    from ckpt.converters.engine.run import ConversionFailed

    rank = int(os.environ.get("RANK", "0") or 0)
    try:
        _run_and_report(run_convert, src, dst, opts, run, as_json, rank)
    except KeyboardInterrupt:
        if rank == 0 and _committed(dst, opts.format):  # it landed after the commit: nothing to undo, say so
            from .group import Interrupted

            raise Interrupted(f"DST {dst} was already committed and is complete") from None
        raise
    except ConversionFailed as e:
        if rank != 0 and not e.own:
            raise click.exceptions.Exit(e.exit_code) from None  # rank 0 says it
        raise


def _committed(dst: str, fmt: str) -> bool:
    """Whether a local ``dst`` holds a committed output once an interrupted conversion has removed what it had not
    committed: DST was new or empty, folder formats publish it whole, ours commits with its manifest."""
    from pathlib import Path

    if "://" in dst and not dst.startswith("file://"):
        return False
    path = Path(dst.removeprefix("file://"))
    if fmt == "ckpt":
        return (path / "manifest.json").is_file()
    return path.is_dir() and any(path.iterdir())


def _run_and_report(run_convert, src: str, dst: str, opts, run, as_json: bool, rank: int) -> None:  # noqa: ANN001
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("converting"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal
        or rank != 0,  # a bar only on a terminal (and rank 0): logs get the result
    ) as bar:
        task = bar.add_task("convert", total=None)

        def on_plan(nbytes: int) -> None:
            bar.update(task, total=nbytes)

        result = run_convert(src, dst, opts, run, progress=lambda n: bar.advance(task, n), on_plan=on_plan)
    if rank != 0:
        return
    if as_json:
        import dataclasses
        import json

        doc = dataclasses.asdict(result)
        doc.pop("rank", None)
        click.echo(json.dumps(doc, indent=2))
        return
    out.print(
        f"converted {count(result.tensors, 'tensor')} ({human_bytes(result.bytes)}) -> {result.dst} [{result.format}]",
        markup=False,  # "[hf]" is text, not a style
    )
    for note in getattr(result, "notes", ()):
        out.print(note, markup=False)
    ranks = getattr(result, "ranks", ())
    if len(ranks) > 1:
        for r in ranks:
            out.print(
                f"  rank {r['rank']}: read {human_bytes(r['bytes_read'])} (+{human_bytes(r['bytes_received'])} from "
                f"other ranks), wrote {human_bytes(r['bytes_written'])}, {r['seconds']:.1f} s",
                markup=False,
            )
