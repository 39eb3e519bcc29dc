"""``ckpt ls ROOT``: the checkpoints under a root, ordered by step, with their status (ckpt or NxD tags)."""

from __future__ import annotations

import json

import click

from .common import human_bytes, layout_text, out


@click.command(epilog="Example: ckpt ls s3://bucket/run/checkpoints")
@click.argument("root")
@click.option("--check-files", is_flag=True, help="Also check that every data file is present at its size.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def ls(root: str, check_files: bool, as_json: bool) -> None:
    """List checkpoints under ROOT: step, time, size, backend, layout, status."""
    from rich.table import Table

    from ckpt.discovery import list_checkpoints
    from ckpt.errors import CkptError
    from ckpt.storage import open_storage

    storage = open_storage(root)
    if not storage.is_dir():
        raise CkptError(f"{root}: no such directory")
    infos = list_checkpoints(storage, check_files=check_files)
    # only a root without a single manifest can be NxD's (whose reader needs torch: imported just for that case)
    if all(i.status == "uncommitted" for i in infos):
        from ckpt.converters.nxd import summary as nxd_summary

        if nxd_summary.is_nxd_dir(root):
            _ls_nxd(nxd_summary.list_nxd(root), root, as_json)
            return
    if as_json:
        rows = [
            {
                "step": i.step,
                "name": i.name,
                "status": i.status,
                "error": i.error,
                "created_at": i.manifest.created_at if i.manifest else None,
                "bytes": i.manifest.total_bytes if i.manifest else None,
                "backend": i.manifest.backend if i.manifest else None,
            }
            for i in infos
        ]
        out.print_json(json.dumps(rows))
        return
    if not infos:
        out.print(f"no checkpoints under {root}")
        return
    table = Table(title=root)
    for col in ("step", "time", "size", "backend", "layout", "status"):
        table.add_column(col, justify="right" if col in ("step", "size") else "left")
    for i in infos:
        m = i.manifest
        status = {"committed": "[green]committed[/]", "uncommitted": "[yellow]uncommitted[/]"}.get(
            i.status, f"[red]damaged[/] {i.error or ''}"
        )
        table.add_row(
            str(i.step),
            m.created_at if m else "",
            human_bytes(m.total_bytes) if m else "",
            m.backend if m else "",
            layout_text(m.layout) if m else "",
            status,
        )
    out.print(table)


def _ls_nxd(rows: list[dict], root: str, as_json: bool) -> None:
    """NxD tags: complete (``done``), unmarked (all files, no ``done``), incomplete; ordered by step."""
    from rich.table import Table

    if as_json:
        out.print_json(json.dumps(rows))
        return
    table = Table(title=f"{root} (NxD)")
    for col in ("step", "tag", "size", "layout", "form", "status"):
        table.add_column(col, justify="right" if col in ("step", "size") else "left")
    colour = {"complete": "green", "unmarked": "yellow", "incomplete": "red"}
    for r in rows:
        layout = " ".join(f"{k}={r[k]}" for k in ("tp", "pp", "dp", "ep") if k in r)
        form = (
            ("xser" if r.get("xser") else "plain") + (" legacy" if r.get("legacy") else "")
            if "xser" in r
            else ""
        )
        problems = f" {r['problems'][0]}" if r["problems"] else ""
        table.add_row(
            "" if r["step"] is None else str(r["step"]),
            r["tag"],
            human_bytes(r["bytes"]) if "bytes" in r else "",
            layout,
            form,
            f"[{colour[r['status']]}]{r['status']}[/]{problems}",
        )
    out.print(table)
