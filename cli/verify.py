"""``ckpt verify CKPT``: every file present at its size, every checksum, full coverage. Exit 0 ok, 1 damaged."""

from __future__ import annotations

import json
import sys

import click

from ckpt.words import count

from .common import EXIT_FOUND, err, out

EPILOG = """\b
Examples:
  ckpt verify run/checkpoints/step_00001000
  ckpt verify s3://bucket/run/checkpoints/step_00001000 --json
  ckpt verify hf_model/            # Hugging Face / DCP folder: every tensor readable (no checksums there)

\b
One line per damaged file, naming what is wrong and the tensors it holds.
Exit codes: 0 intact, 1 damaged, 2 cannot run (not a checkpoint, unreadable or unsupported input).
"""


@click.command(epilog=EPILOG)
@click.argument("checkpoint")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify(checkpoint: str, as_json: bool) -> None:
    """Check that CHECKPOINT is complete and its data matches the manifest's checksums.

    CHECKPOINT is one of ours (its folder or its manifest.json), an NxD tag (zip CRC32s), or a Hugging Face or DCP
    folder (headers, sizes, every tensor readable).
    """
    from .where import resolve_checkpoint

    checkpoint, kind = resolve_checkpoint(checkpoint, "verify")
    if kind in ("hf", "dcp", "adapter", "accelerate", "lightning"):
        from .foreign import verify_foreign

        problems = verify_foreign(checkpoint, as_json)
        _report_problems(checkpoint, problems, as_json)
        return
    if kind == "nxd":
        _verify_nxd(checkpoint, as_json)
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from ckpt.format.integrity import verify_checkpoint
    from ckpt.format.reader import CheckpointReader

    reader = CheckpointReader(checkpoint)
    total = sum(s.nbytes for t in reader.manifest.tensors.values() for s in t.shards)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task("verifying", total=total)
        problems = verify_checkpoint(reader, lambda n: bar.advance(task, n))
    m = reader.manifest
    if as_json:
        doc = {"path": checkpoint, "format": "ckpt", "ok": not problems, "step": m.step,
               "tensors": len(m.tensors), "files": len(m.files), "problems": problems, "checksums": True}  # fmt: skip
        click.echo(json.dumps(doc, indent=2))
    _report_problems(checkpoint, problems, as_json)
    if not as_json:
        out.print(
            f"[green]ok[/] {checkpoint}: step {m.step}, {count(len(m.tensors), 'tensor')}, "
            f"{count(len(m.files), 'file')} verified",
            highlight=False,
        )


def _report_problems(checkpoint: str, problems: list[str], as_json: bool) -> None:
    """Each problem on stderr, one line per damaged file (unless --json carries them), and exit 1; nothing when
    there is none."""
    if not problems:
        return
    if not as_json:
        for p in problems:
            err.print(f"damaged {checkpoint}: {p}", markup=False)
    sys.exit(EXIT_FOUND)


def _verify_nxd(tag: str, as_json: bool) -> None:
    """An NxD tag: every rank file present, every zip member's CRC32 (a damaged file raises CorruptionError)."""
    from ckpt.converters.nxd.reader import open_tag

    r = open_tag(tag, verify=True)
    r.check_complete()
    t = r.read()
    n = sum(len(m) for m in t.per_rank_model.values())
    if as_json:
        click.echo(json.dumps({"path": tag, "format": "nxd", "ok": True, "ranks": len(t.per_rank_model),
                               "tensors": n, "problems": [], "checksums": True}, indent=2))  # fmt: skip
        return
    out.print(
        f"ok {tag}: NxD tag, {count(len(t.per_rank_model), 'rank file')}, {count(n, 'model tensor')}, "
        "CRC32s verified",
        markup=False,
    )
