"""Reading and editing a saved checkpoint's manifest the same way under format v1 and v2, for tests.

Tests assert facts about a manifest (its tensors, shards, files, trees), not about how one format version lays them
out on disk, so they read through the public reader (:func:`ckpt.format.reader.read_manifest`), which gives the full
in-memory :class:`~ckpt.format.manifest.Manifest` from either version.  Tests that edit a manifest on disk (a gap, a bad
field) edit the v1-shaped document of it and have it written back in the version it was stored in, sealed as a
(buggy) tool would write it, so that what they damage is the fact they mean to damage, not the encoding.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt.format.manifest import MANIFEST_NAME, Manifest, seal
from ckpt.format.reader import read_manifest
from ckpt.storage import open_storage


def load_manifest(path: str | Path) -> Manifest:
    """The full manifest of the checkpoint at ``path`` (every v2 index read into it)."""
    return read_manifest(open_storage(str(path)))


def manifest_dict(path: str | Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` as the v1 JSON document of the same facts (``tensors`` with
    their ``shards``, every rank's ``rng``/``data`` trees), whichever version is on disk."""
    return json.loads(load_manifest(path).to_json())


def stored_version(path: str | Path) -> int:
    """The ``format_version`` of the top manifest on disk."""
    return int(json.loads((Path(path) / MANIFEST_NAME).read_text())["format_version"])


def index_files(path: str | Path) -> list[str]:
    """The files a v2 top manifest lists besides the data files: each rank's index and state file (empty for v1)."""
    return sorted(sidecars(json.loads((Path(path) / MANIFEST_NAME).read_text())))


def sidecars(top: dict[str, Any]) -> list[str]:
    """The index and state files listed in the top manifest document ``top`` (none in v1)."""
    return [*(top.get("indexes") or {}), *(top.get("rank_state") or {})]


def edit_top(path: str | Path, edit: Callable[[dict[str, Any]], None], *, reseal: bool = True) -> None:
    """Edit the top-level members of the stored manifest (``step``, ``format_version``, ``data_position``, ...:
    the members both versions hold in ``manifest.json``) and write it back, re-sealed unless ``reseal=False``."""
    p = Path(path) / MANIFEST_NAME
    doc = json.loads(p.read_text())
    edit(doc)
    p.write_text(seal(doc) if reseal else json.dumps(doc))


def rewrite_manifest(path: str | Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the full manifest of the checkpoint at ``path`` as its v1 document (``tensors[n]["shards"]``, ...) and
    write it back sealed, in the version it is stored in (v2: its indexes re-encoded, the top re-sealed over
    their new checksums, index files no longer listed removed)."""
    root = Path(path)
    version = stored_version(root)
    doc = manifest_dict(root)
    edit(doc)
    if version == 1:
        (root / MANIFEST_NAME).write_text(seal(doc))
        return
    from ckpt.format.index import encode

    old = index_files(root)
    attempt = old[0].split("-", 1)[1].split(".", 1)[0] if old else "edited"
    top, indexes = encode(Manifest.from_json(seal(doc), "edited manifest"), attempt)
    for name in old:
        if name not in indexes:
            (root / name).unlink()
    for name, text in indexes.items():
        (root / name).write_text(text)
    (root / MANIFEST_NAME).write_text(top)
