"""``ckpt ls ROOT``: the checkpoints under a root, ordered by step, with their status (ckpt or NxD tags)."""

from __future__ import annotations

import json
import sys

import click

from ckpt.words import count

from .common import human_bytes, layout_text, out

EPILOG = """\b
Examples:
  ckpt ls run/checkpoints
  ckpt ls s3://bucket/run/checkpoints --check-files --json

\b
A checkpoint is "committed" when its manifest is valid and every data file it lists is in its folder (with
--check-files: also at its size). Exit codes: 0 listed, 1 a checkpoint is damaged, 2 bad input.
"""


@click.command(epilog=EPILOG)
@click.argument("root")
@click.option("--check-files", is_flag=True, help="Also check that every data file has its size.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def ls(root: str, check_files: bool, as_json: bool) -> None:
    """List checkpoints under ROOT: step, time, size, backend, layout, status."""
    import dataclasses

    from rich.text import Text

    from ckpt.discovery import absent_files, list_checkpoints
    from ckpt.errors import CkptError
    from ckpt.storage import open_storage

    from .table import Col, print_table
    from .where import explain_empty_root, might_be_nxd

    storage = open_storage(root)
    if not storage.is_dir():
        raise CkptError(f"{root}: no such directory")
    infos = list_checkpoints(storage, check_files=check_files)
    # only a root without a single manifest can be NxD's (whose reader needs torch: imported just for that case)
    if all(i.status == "uncommitted" for i in infos) and might_be_nxd(storage):
        from ckpt.converters.nxd import summary as nxd_summary

        if nxd_summary.is_nxd_dir(root):
            _ls_nxd(nxd_summary.list_nxd(root), root, as_json)
            return
    if not check_files:
        # a deleted data file is visible in the folder's listing: one listing each, no stat
        for k, i in enumerate(infos):
            if i.status == "committed" and i.manifest is not None:
                gone = absent_files(storage.child(i.name), i.manifest)
                if gone:
                    error = f"{storage.child(i.name).display()}: {', '.join(gone[:4])}"
                    infos[k] = dataclasses.replace(i, status="damaged", error=error)
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
                "layout": dataclasses.asdict(i.manifest.layout) if i.manifest else None,
            }
            for i in infos
        ]
        click.echo(json.dumps(rows, indent=2))
        _exit(infos, root)
    if not infos:
        why = explain_empty_root(root, storage)
        if why is not None:
            raise CkptError(why)
        click.echo(f"no checkpoints under {root}")
        return
    style = {"committed": "green", "uncommitted": "yellow"}
    rows = []
    for i in infos:
        m = i.manifest
        status = Text(i.status, style=style.get(i.status, "red"))
        if i.status == "damaged":
            status.append(f" {i.error or ''}")
        rows.append(
            [
                str(i.step),
                m.created_at if m else "",
                human_bytes(m.total_bytes) if m else "",
                m.backend if m else "",
                layout_text(m.layout).strip() if m else "",
                status,
            ]
        )
    cols = [Col("step", "right"), Col("time"), Col("size", "right"), Col("backend"), Col("layout"),
            Col("status", fold=True)]  # fmt: skip
    print_table(out, cols, rows, title=root)
    _exit(infos, root)


def _exit(infos: list, root: str) -> None:
    """Exit 1 when a checkpoint is damaged, saying so on stderr too (scripts that read only stderr and the exit
    code see why), 0 otherwise."""
    bad = [i.name for i in infos if i.status == "damaged"]
    if bad:
        click.echo(
            f"ckpt: {len(bad)} of {count(len(infos), 'checkpoint')} under {root} damaged: {', '.join(bad[:4])}",
            err=True,
        )
        sys.exit(1)
    sys.exit(0)


def _ls_nxd(rows: list[dict], root: str, as_json: bool) -> None:
    """NxD tags: complete (``done``), unmarked (all files, no ``done``), incomplete; ordered by step."""
    from rich.text import Text

    from .table import Col, print_table

    if as_json:
        click.echo(json.dumps(rows, indent=2))
        sys.exit(_nxd_exit(rows))
    colour = {"complete": "green", "unmarked": "yellow", "incomplete": "red", "damaged": "red"}
    table = []
    for r in rows:
        layout = " ".join(f"{k}={r[k]}" for k in ("tp", "pp", "dp", "ep") if k in r)
        form = (
            ("xser" if r.get("xser") else "plain") + (" legacy" if r.get("legacy") else "")
            if "xser" in r
            else ""
        )
        status = Text(r["status"], style=colour[r["status"]])
        if r["problems"]:
            status.append(f" {r['problems'][0]}")
        table.append(
            [
                "" if r["step"] is None else str(r["step"]),
                r["tag"],
                human_bytes(r["bytes"]) if "bytes" in r else "",
                layout,
                form,
                status,
            ]
        )
    cols = [Col("step", "right"), Col("tag", name=True), Col("size", "right"), Col("layout"), Col("form"),
            Col("status", fold=True)]  # fmt: skip
    print_table(out, cols, table, title=f"{root} (NxD)")
    sys.exit(_nxd_exit(rows))


def _nxd_exit(rows: list[dict]) -> int:
    """1 when a tag is damaged (marked ``done``, files missing or torn); an incomplete tag is a save that did not
    finish."""
    return 1 if any(r["status"] == "damaged" for r in rows) else 0
