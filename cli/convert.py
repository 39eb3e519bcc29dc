"""``ckpt convert SRC DST``: between Neuron (NxD TP/PP/ZeRO-1) and CUDA (full / FSDP / DCP / Hugging Face) layouts.

Thin: parses flags into :class:`ckpt.converters.convert.ConvertOptions`, shows a progress bar, prints the plan for
``--dry-run``.  Every impossible request fails before any work with one line and exit code 2.
"""

from __future__ import annotations

import click

from ckpt.errors import CkptError

from .common import err, human_bytes, out


@click.command("convert", context_settings={"help_option_names": ["-h", "--help"]})
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
    type=click.Choice(["ckpt", "dcp", "hf", "nxd"]),
    default="ckpt",
    show_default=True,
    help="Format of DST.",
)
@click.option("--tp", type=int, default=1, show_default=True, help="Neuron target: tensor-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Neuron target: pipeline-parallel size.")
@click.option(
    "--dp",
    type=int,
    default=1,
    show_default=True,
    help="Neuron target: data-parallel size (ZeRO-1 shards for --format nxd).",
)
@click.option(
    "--virtual-pp",
    type=int,
    default=1,
    show_default=True,
    help="Neuron target: virtual pipeline stages per rank.",
)
@click.option(
    "--kv-size-multiplier", type=int, default=1, show_default=True, help="Neuron target: KV head replication."
)
@click.option(
    "--hw",
    type=click.Choice(["trn1", "trn2"]),
    default="trn1",
    show_default=True,
    help="Neuron KV head order.",
)
@click.option("--fuse-qkv", is_flag=True, help="Neuron target: fused QKV weights.")
@click.option(
    "--qkv-linear",
    is_flag=True,
    help="Neuron target: GQAQKVColumnParallelLinear names (qkv_proj.weight_q|k|v).",
)
@click.option(
    "--config", "config_path", type=str, default=None, help="Hugging Face config.json of the model."
)
@click.option("--step", type=int, default=None, help="Step to record (default: the source's).")
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
    help="--format hf: largest shard file (bytes, or with KB/MB/GB/KiB/MiB/GiB); shards are what --workers share.",
)
@click.option(
    "--dry-run", is_flag=True, help="Print the plan (tensors, bytes, peak memory) and write nothing."
)
def convert(
    src: str,
    dst: str,
    from_: str | None,
    to: str,
    fmt: str,
    tp: int,
    pp: int,
    dp: int,
    virtual_pp: int,
    kv_size_multiplier: int,
    hw: str,
    fuse_qkv: bool,
    qkv_linear: bool,
    config_path: str | None,
    step: int | None,
    workers: int,
    max_shard_size: str,
    dry_run: bool,
) -> None:
    """Convert checkpoint SRC into DST (SRC is never written; DST is committed atomically)."""
    from ckpt.converters.convert import ConvertOptions, describe, load_config, open_source, plan_conversion
    from ckpt.converters.convert import convert as run_convert

    opts = ConvertOptions(
        to=to,  # type: ignore[arg-type]
        format=fmt,  # type: ignore[arg-type]
        from_=from_,  # type: ignore[arg-type]
        tp=tp,
        pp=pp,
        dp=dp,
        virtual_pp=virtual_pp,
        kv_size_multiplier=kv_size_multiplier,
        hw=hw,
        fuse_qkv=fuse_qkv,
        qkv_linear=qkv_linear,
        config=load_config(config_path),
        step=step,
        workers=workers,
        max_shard_bytes=parse_size(max_shard_size, "--max-shard-size"),
    )
    if dry_run:
        conv = plan_conversion(open_source(src, opts), opts)
        d = describe(conv, opts)
        out.print(f"plan: {d['source']['format']} ({d['source']['layout']}) {src} -> {fmt} ({to}) {dst}")
        if d["target"]["spec"]:
            out.print(f"  layout: {d['target']['spec']}")
        out.print(
            f"  tensors: {d['tensors']} ({', '.join(f'{k} {v}' for k, v in sorted(d['by_role'].items()))})"
        )
        out.print(f"  bytes: {human_bytes(d['bytes'])} ({d['bytes']})")
        out.print(f"  largest tensor: {human_bytes(d['largest_tensor'])}")
        out.print(f"  peak memory estimate: {human_bytes(d['peak_memory_estimate'])} per worker")
        out.print(f"  step: {d['step']}, workers: {workers}")
        return
    _run(run_convert, src, dst, opts)


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


def _run(run_convert, src: str, dst: str, opts) -> None:  # noqa: ANN001 - internal
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
        disable=not err.is_terminal,  # a bar only on a terminal: logs get the result line and nothing else
    ) as bar:
        task = bar.add_task("convert", total=None)

        def on_plan(conv) -> None:  # noqa: ANN001
            bar.update(task, total=conv.nbytes)

        result = run_convert(src, dst, opts, progress=lambda n: bar.advance(task, n), on_plan=on_plan)
    out.print(
        f"converted {result.tensors} tensors ({human_bytes(result.bytes)}) -> {result.dst} [{result.format}]",
        markup=False,  # "[hf]" is text, not a style
    )
