"""``ckpt ls ROOT``: every checkpoint under a root, ordered by step, with its status.

Ours at any name up to :data:`~ckpt.restoring.discovery.FIND_DEPTH` levels down (``step_<N>``, ``conv/gpu-500``), NxD tags,
HF Trainer ``checkpoint-N``, HF and DCP folders: one table per kind, one JSON list with a ``format`` per row.  Each
status comes from the checks the kind's reader makes when ``verify`` / ``convert`` opens it (our manifest and its
files; an NxD tag's files and zip directories; a foreign folder's headers and sizes).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from ckpt.words import count

from .common import EXIT_CANNOT_RUN, EXIT_FOUND, EXIT_OK, human_bytes, layout_text, out

if TYPE_CHECKING:
    from ckpt.restoring.discovery import CheckpointInfo, Found
    from ckpt.storage import Storage

EPILOG = """\b
Examples:
  ckpt ls run/checkpoints
  ckpt ls s3://bucket/run/checkpoints --check-files --json

\b
Lists ours at any folder name up to 3 levels down, NxD tags, HF Trainer checkpoint-N, HF, DCP and accelerate
save_state folders.
One of ours is "committed" when its manifest is valid and every file it lists is in its folder at its size
(one stat per file, no reads; on an object store sizes are asked only with --check-files), else "damaged";
an NxD tag marked done whose files are missing or torn is "damaged".
A step no file records shows as "unknown". Exit codes: 0 listed, 1 a checkpoint is damaged, 2 cannot run (bad input, or a checkpoint
of a tool ckpt does not read yet: a Lightning .ckpt).
"""


@click.command(epilog=EPILOG)
@click.argument("root")
@click.option("--check-files", is_flag=True, help="On an object store, also ask each file's size (local folders: always).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def ls(root: str, check_files: bool, as_json: bool) -> None:
    """List the checkpoints under ROOT (ours, NxD tags, Trainer/HF/DCP/accelerate folders): step, size, status."""
    from ckpt.errors import CkptError
    from ckpt.restoring.discovery import find_checkpoints, list_checkpoints
    from ckpt.restoring.other_tools import KINDS, LIGHTNING, file_tool, not_supported
    from ckpt.storage import open_storage

    from .where import explain_empty_root

    storage = open_storage(root)
    if storage.local and file_tool(root) == LIGHTNING:
        raise CkptError(f"{root} is a Lightning .ckpt file; run: ckpt inspect {root}")
    if storage.local and file_tool(root) is not None:
        raise CkptError(not_supported(root, file_tool(root) or ""))
    if not storage.is_dir():
        raise CkptError(f"{root}: no such directory")
    # a local folder's files are stat'ed (sizes against the manifest, no reads); an object store's only listed,
    # unless --check-files asks for one request per file
    check_files = check_files or storage.local
    found = find_checkpoints(storage)
    if len(found) == 1 and found[0].rel == "" and found[0].kind in KINDS:
        raise CkptError(not_supported(root, found[0].kind))
    unsupported = [{"format": f.kind, "step": None, "name": f.rel, "status": "unsupported", "problems": []}
                   for f in found if f.kind in KINDS and f.kind != LIGHTNING]  # fmt: skip
    found = [f for f in found if f.kind not in KINDS or f.kind == LIGHTNING]
    if len(found) == 1 and found[0].rel == "" and found[0].kind != "nxd":
        raise CkptError(
            explain_empty_root(root, storage) or f"{root} is a checkpoint; run: ckpt inspect {root}"
        )
    # ours: the step_<N> folders (with the uncommitted leftovers among them) and any other folder with a manifest
    other = {f.rel for f in found if f.kind != "ckpt"}  # an NxD tag named step_3 is not an uncommitted save
    infos = [i for i in list_checkpoints(storage, check_files=check_files) if i.name not in other]
    listed = {i.name for i in infos}
    infos += [_ours(storage, f.rel, check_files) for f in found if f.kind == "ckpt" and f.rel not in listed]
    infos = [_absent(storage, i) if not check_files else i for i in infos]
    infos.sort(key=lambda i: (i.step is None, i.step or 0, i.name))
    others = [f for f in found if f.kind != "ckpt"]
    nxd_rows = _nxd_rows(storage, [f for f in others if f.kind == "nxd"])
    foreign = _foreign_rows(storage, [f for f in others if f.kind != "nxd"]) + unsupported
    if as_json:
        rows = [_ours_json(i) for i in infos] + nxd_rows + foreign
        click.echo(json.dumps(rows, indent=2))
        _exit(infos, nxd_rows, foreign, root)
    if not infos and not nxd_rows and not foreign:
        click.echo(f"no checkpoints under {root}")
        return
    if infos:
        _ours_table(infos, root)
    if nxd_rows:
        _nxd_table(nxd_rows, root)
    if foreign:
        _foreign_table(foreign, root)
    _exit(infos, nxd_rows, foreign, root)


def _ours(storage: Storage, rel: str, check_files: bool) -> CheckpointInfo:
    from ckpt.restoring.discovery import inspect_any

    return inspect_any(storage, rel, check_files)


def _absent(storage: Storage, i: CheckpointInfo) -> CheckpointInfo:
    """A deleted data file is visible in the folder's listing: one listing each, no stat."""
    import dataclasses

    from ckpt.restoring.discovery import absent_files

    if i.status == "committed" and i.manifest is not None:
        sub = storage.child(i.name)
        gone = absent_files(sub, i.manifest)
        if gone:
            return dataclasses.replace(i, status="damaged", error=f"{sub.display()}: {', '.join(gone[:4])}")
    return i


def _ours_json(i: CheckpointInfo) -> dict[str, Any]:
    import dataclasses

    m = i.manifest
    return {
        "format": "ckpt",
        "step": i.step,
        "name": i.name,
        "status": i.status,
        "error": i.error,
        "created_at": m.created_at if m else None,
        "bytes": m.total_bytes if m else None,
        "backend": m.backend if m else None,
        "layout": dataclasses.asdict(m.layout) if m else None,
    }


def _step_text(step: int | None) -> str:
    return "unknown" if step is None else str(step)


def _ours_table(infos: list[CheckpointInfo], root: str) -> None:
    from rich.text import Text

    from .table import Col, print_table

    named = any("/" in i.name or not i.name.startswith("step_") for i in infos)  # not all step_<N> of ROOT
    style = {"committed": "green", "uncommitted": "yellow"}
    rows = []
    for i in infos:
        m = i.manifest
        status = Text(i.status, style=style.get(i.status, "red"))
        if i.status == "damaged":
            status.append(f" {i.error or ''}")
        rows.append(
            [
                _step_text(i.step),
                *([i.name] if named else []),
                m.created_at if m else "",
                human_bytes(m.total_bytes) if m else "",
                m.backend if m else "",
                layout_text(m.layout).strip() if m else "",
                status,
            ]
        )
    cols = [Col("step", "right"), *([Col("checkpoint", name=True)] if named else []), Col("time"),
            Col("size", "right"), Col("backend"), Col("layout"), Col("status", fold=True)]  # fmt: skip
    print_table(out, cols, rows, title=root)


def _exit(infos: list[CheckpointInfo], nxd_rows: list[dict], foreign: list[dict], root: str) -> None:
    """Exit 1 when a checkpoint is damaged, saying so on stderr too (scripts that read only stderr and the exit
    code see why); else 2 when one is of a tool not supported yet (it cannot be read: named, never passed over as
    nothing); else 0.  An NxD tag without ``done`` that misses files is a save that did not finish, not damage."""
    from ckpt.restoring.other_tools import WHAT

    from .group import ERROR_PREFIX

    bad = [i.name for i in infos if i.status == "damaged"]
    bad += [r["tag"] for r in nxd_rows if r["status"] == "damaged"]
    bad += [r["name"] for r in foreign if r["status"] == "damaged"]
    total = len(infos) + len(nxd_rows) + len(foreign)
    if bad:
        click.echo(
            f"ckpt: {len(bad)} of {count(total, 'checkpoint')} under {root} damaged: {', '.join(bad[:4])}",
            err=True,
        )
        sys.exit(EXIT_FOUND)
    other = [r for r in foreign if r["status"] == "unsupported"]
    if other:
        named = ", ".join(f"{r['name']} ({WHAT[r['format']]})" for r in other[:4])
        more = f" and {len(other) - 4} more" if len(other) > 4 else ""
        click.echo(
            f"{ERROR_PREFIX}{count(len(other), 'checkpoint')} under {root} of tools ckpt does not read yet: "
            f"{named}{more}",
            err=True,
        )
        sys.exit(EXIT_CANNOT_RUN)
    sys.exit(EXIT_OK)


def _nxd_rows(storage: Storage, tags: list[Found]) -> list[dict]:
    """NxD tags: their rows (:func:`~ckpt.converters.nxd.summary.list_nxd`; torch only when there are some)."""
    if not tags:
        return []
    from ckpt.converters.nxd import summary as nxd_summary

    top = storage.local_path()
    rows = []
    for f in tags:
        for r in nxd_summary.list_nxd(f"{top}/{f.rel}" if f.rel else top):
            rows.append({"format": "nxd", **r, "tag": f.rel or r["tag"]})
    from ckpt.converters.nxd.naming import parse_step

    def order(r: dict) -> tuple:  # by step, then as list_tags orders tags: by the number in the name
        n = parse_step(r["tag"].rsplit("/", 1)[-1])
        return (r["step"] is None, r["step"] or 0, n is None, n or 0, r["tag"])

    return sorted(rows, key=order)


def _nxd_table(rows: list[dict], root: str) -> None:
    """NxD tags: complete (``done``), damaged (``done``, files missing), unmarked (all files, no ``done``),
    incomplete; ordered by step."""
    from rich.text import Text

    from .table import Col, print_table

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
                _step_text(r["step"]),
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


_FORMAT_WORDS = {"hf-trainer": "HF Trainer", "hf-trainer-lora": "HF Trainer LoRA", "hf": "Hugging Face", "dcp": "DCP",
                 "accelerate": "accelerate", "lightning": "Lightning"}  # fmt: skip


def _foreign_rows(storage: Storage, folders: list[Found]) -> list[dict]:
    """Trainer ``checkpoint-N``, HF and DCP folders, checked as ``convert`` / ``verify`` open them (every file
    present, headers consistent with file sizes); the step is a Trainer's ``global_step``, else unknown."""
    if not folders:
        return []
    from ckpt.converters import formats

    from ckpt.errors import CkptError

    top = storage.local_path()
    rows = []
    for f in folders:
        path = f"{top}/{f.rel}" if f.rel else top
        row: dict = {"format": f.kind, "step": None, "name": f.rel, "status": "ok", "problems": []}
        try:
            if f.kind == "hf-trainer-lora":
                from ckpt.converters.lora_trainer import AdapterFolder

                source = AdapterFolder(path)
            else:
                source = formats.get(f.kind).load().open_source(path)
        except CkptError as e:
            row.update(status="damaged", problems=[str(e)])
        else:
            try:
                row["step"] = source.trees.step if source.step_recorded else None
                row["tensors"] = len(source.tensors)
                row["bytes"] = sum(d.nbytes for d in source.tensors.values())
            finally:
                source.close()
        rows.append(row)
    return sorted(rows, key=lambda r: (r["step"] is None, r["step"] or 0, r["name"]))


def _foreign_table(rows: list[dict], root: str) -> None:
    from rich.text import Text

    from .table import Col, print_table

    table = []
    for r in rows:
        shown = "not supported yet" if r["status"] == "unsupported" else r["status"]
        status = Text(shown, style="green" if r["status"] == "ok" else "red")
        if r["problems"]:
            status.append(f" {r['problems'][0]}")
        table.append(
            [
                _step_text(r["step"]),
                r["name"],
                _FORMAT_WORDS[r["format"]],
                human_bytes(r["bytes"]) if "bytes" in r else "",
                status,
            ]
        )
    cols = [Col("step", "right"), Col("folder", name=True), Col("format"), Col("size", "right"),
            Col("status", fold=True)]  # fmt: skip
    print_table(out, cols, table, title=f"{root} (other formats)")
