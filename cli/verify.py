"""``ckpt verify CKPT``: every file present at its size, every checksum, full coverage. Exit 0 ok, 1 damaged."""

from __future__ import annotations

import sys

import click

from .common import err, out


@click.command(epilog="Exit codes: 0 intact, 1 damaged (each bad file and tensor named), 2 not a checkpoint.")
@click.argument("checkpoint")
def verify(checkpoint: str) -> None:
    """Check that CHECKPOINT is complete and its data matches the manifest's checksums."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from ckpt.integrity import verify_checkpoint
    from ckpt.reader import CheckpointReader

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
    if problems:
        for p in problems:
            err.print(f"[red]damaged[/] {checkpoint}: {p}")
        err.print(f"{len(problems)} problem(s) in {checkpoint}")
        sys.exit(1)
    m = reader.manifest
    out.print(
        f"[green]ok[/] {checkpoint}: step {m.step}, {len(m.tensors)} tensors, {len(m.files)} files verified"
    )
