"""``ckpt inspect CKPT``: what a checkpoint holds — tensors, shapes, dtypes, shards, and the training state."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .common import human_bytes, layout_text, out


@click.command(epilog="Example: ckpt inspect run/checkpoints/step_00001000 --json")
@click.argument("checkpoint")
@click.option("--json", "as_json", is_flag=True, help="Print the tensors and state as JSON.")
@click.option("--shards", is_flag=True, help="List every shard (file, offset, box, codec).")
def inspect(checkpoint: str, as_json: bool, shards: bool) -> None:
    """Show the tensors (name, role, shape, dtype, shards) and training state of CHECKPOINT (or an NxD tag)."""
    from rich.table import Table

    from ckpt.reader import CheckpointReader

    if not Path(checkpoint, "manifest.json").exists():
        # NxD's reader needs torch: imported only for a folder that is not ours
        from ckpt.converters.nxd import summary as nxd_summary

        if nxd_summary.is_nxd_dir(checkpoint):
            _inspect_nxd(nxd_summary.inspect_nxd(checkpoint), as_json)
            return
    m = CheckpointReader(checkpoint).manifest
    if as_json:
        doc = json.loads(m.to_json())  # the in-memory manifest, every chunk in place (v2: its indexes read)
        doc["format_version"] = m.format_version
        if not shards:
            for t in doc["tensors"].values():
                t["shards"] = len(t["shards"])
        out.print_json(json.dumps(doc))
        return
    out.print(
        f"[bold]{checkpoint}[/]  step {m.step}  {m.backend}  {layout_text(m.layout)}  "
        f"{human_bytes(m.total_bytes)} in {len(m.files)} files  (format v{m.format_version}, {m.created_at})"
    )
    table = Table()
    for col in ("tensor", "role", "shape", "dtype", "shards", "size"):
        table.add_column(col, overflow="fold")
    for name, t in m.tensors.items():
        table.add_row(
            name,
            t.role + (f" ({t.key})" if t.key else ""),
            str(list(t.shape)),
            t.dtype,
            str(len(t.shards)),
            human_bytes(t.nbytes),
        )
        if shards:
            for s in t.shards:
                table.add_row(
                    f"  {s.file}@{s.offset}",
                    s.codec,
                    f"{list(s.box.offsets)}+{list(s.box.lengths)}",
                    "",
                    "",
                    human_bytes(s.nbytes),
                )
    out.print(table)
    if m.optimizer:
        out.print(f"optimizer: {m.optimizer['type']}, {len(m.optimizer['param_groups'])} param group(s)")
    for label, value in (("scheduler", m.scheduler), ("scaler", m.scaler)):
        if value is not None:
            out.print(f"{label}: {', '.join(sorted(value)) if isinstance(value, dict) else value}")
    out.print(f"progress: {m.progress}")
    if m.rng:
        out.print(f"rng: ranks {', '.join(sorted(m.rng, key=int))}")
    if m.data:
        out.print(f"data-loader state: ranks {', '.join(sorted(m.data, key=int))}")
    if m.tokenizer:
        out.print(f"tokenizer: {m.tokenizer.get('name')} sha256 {str(m.tokenizer.get('sha256'))[:16]}")
    versions = m.environment.get("versions", {})
    out.print("environment: " + ", ".join(f"{k} {v}" for k, v in versions.items()))


def _inspect_nxd(doc: dict, as_json: bool) -> None:
    from rich.table import Table

    if as_json:
        out.print_json(json.dumps(doc))
        return
    flags = [k for k in ("xser", "zero1", "legacy", "optimizer", "scheduler", "user_content") if doc[k]]
    out.print(
        f"[bold]{doc['path']}[/]  NxD tag {doc['tag']}  step {doc['step']}  {doc['status']}  "
        f"tp={doc['tp']} pp={doc['pp']} dp={doc['dp']} ep={doc['ep']}  {' '.join(flags)}"
    )
    for p in doc["problems"]:
        out.print(f"[red]problem:[/] {p}")
    table = Table()
    for col in ("rank", "tensor", "shape"):
        table.add_column(col, overflow="fold")
    for rank, tensors in doc["ranks"].items():
        for name, shape in tensors:
            table.add_row(rank, name, str(shape))
    out.print(table)
