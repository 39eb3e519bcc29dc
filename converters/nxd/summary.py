"""What ``ckpt ls`` / ``ckpt inspect`` show for NxD folders: plain dicts built from file names and metadata only.

Kept here (not in the CLI) so that the commands stay thin and the same facts are available to other tools.
Listing reads no tensor data and checks no CRC; inspecting reads shapes (from ``.info.pt`` for xser, else the
model files, whose zip CRC32s are then checked), through the safe unpickler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt.errors import CkptError

from .discovery import TagInfo, _looks_like_tag, list_tags, tag_status
from .files import scan_tag
from .reader import open_tag
from .step import tag_step


def is_nxd_dir(path: str | Path) -> bool:
    """True for a local directory that is an NxD tag or holds NxD tags."""
    p = Path(path)
    if not p.is_dir() or "://" in str(path):
        return False
    if _looks_like_tag(p):
        return True
    try:
        return bool(list_tags(p))
    except CkptError:
        return False


def _row(info: TagInfo) -> dict[str, Any]:
    row: dict[str, Any] = {
        "step": None,  # unknown until the tag's files say (never the digits of its name)
        "tag": info.name,
        "status": info.status.value,
        "problems": list(info.problems),
    }
    try:
        f = scan_tag(info.path)
    except CkptError:
        return row
    sizes = [p.stat().st_size for p in info.path.rglob("*") if p.is_file()]
    # the step the tag's contents name (listing checks no CRC and does not warn; inspect and convert do)
    row["step"] = tag_step(f, verify=False, warn=False)
    row.update(
        tp=f.tp_size, pp=f.pp_size, dp=f.dp_size, ep=f.ep_size, xser=f.xser, legacy=f.is_legacy,
        optimizer=bool(f.optim), bytes=sum(sizes),
    )  # fmt: skip
    return row


def list_nxd(root: str | Path) -> list[dict[str, Any]]:
    """One row per tag (ordered by step, like :func:`list_tags`); a tag directory itself gives one row."""
    p = Path(root)
    if _looks_like_tag(p) and not any(_looks_like_tag(d) for d in p.iterdir() if d.is_dir()):
        return [_row(tag_status(p))]
    return [_row(t) for t in list_tags(p)]


def inspect_nxd(tag_dir: str | Path) -> dict[str, Any]:
    """Tag facts plus, per (tp, pp, ep) rank, its tensors' names and shapes in stored order.

    Raises :class:`~ckpt.errors.CorruptionError` for a missing rank file (the table would silently lack that
    rank) and for a damaged file (plain files are read, so their zip CRC32s are checked; xser tags with
    ``.info.pt`` read no tensor data and are not CRC-checked here).
    """
    r = open_tag(tag_dir)
    r.check_complete()
    m = r.meta
    return {
        "tag": m.name,
        "path": str(m.path),
        "step": m.step,
        "status": m.status.value,
        "problems": list(m.problems),
        "tp": m.tp_size,
        "pp": m.pp_size,
        "dp": m.dp_size,
        "ep": m.ep_size,
        "xser": m.xser,
        "zero1": m.zero1,
        "legacy": m.legacy,
        "optimizer": bool(r.files.optim),
        "scheduler": r.files.scheduler is not None,
        "user_content": r.files.user_content is not None,
        "ranks": {
            f"tp{tp}_pp{pp}_ep{ep}": [[n, list(s)] for n, s in r.model_shapes((tp, pp, ep))]
            for tp, pp, ep in r.ranks
        },
    }
