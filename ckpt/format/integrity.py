"""Integrity of a checkpoint's stored bytes: every file present at its size, every shard's checksum, full coverage.

(Whether training *resumed* correctly from a checkpoint is :mod:`ckpt.resume.verify`'s question, not this one's.)

Used by ``ckpt verify`` and by tools that must not trust a checkpoint blindly.  Each problem names the file and
the tensor it affects, so a damaged checkpoint can be repaired or discarded knowingly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CkptError
from ..storage import Storage
from ..words import count
from .manifest import Manifest
from .reader import CheckpointReader


@dataclass(frozen=True)
class Problem:
    file: str | None
    tensor: str | None
    message: str

    def __str__(self) -> str:
        where = " ".join(x for x in (self.file, f"tensor {self.tensor!r}" if self.tensor else None) if x)
        return f"{where}: {self.message}" if where else self.message


def _overlaps(shards: tuple) -> bool:
    for i, a in enumerate(shards):
        for b in shards[i + 1 :]:
            inter = a.box.intersect(b.box)
            if inter is not None and inter.numel > 0:
                return True
    return False


def coverage_problems(m: Manifest, max_pairwise: int = 512) -> list[Problem]:
    """Tensors whose shards do not tile them exactly (gaps or overlaps).

    The element count catches gaps; the pairwise overlap test (quadratic) runs for tensors with at most
    ``max_pairwise`` shards, which covers every layout ckpt writes.
    """
    out = []
    for name, t in m.tensors.items():
        total = math.prod(t.shape)
        stored = sum(s.box.numel for s in t.shards)
        overlap = len(t.shards) <= max_pairwise and _overlaps(t.shards)
        if stored != total or overlap:
            note = " (overlapping)" if overlap else ""
            out.append(Problem(None, name, f"shards hold {stored} of {total} elements{note}"))
    return out


def file_problems(storage: Storage, m: Manifest) -> dict[str, str]:
    """Files the manifest lists (data files, and format v2's rank indexes) that are absent or not at their size,
    each with what is wrong with it.  One stat per file, no reads: what ``ls`` and ``inspect`` check, and the
    first thing ``verify`` checks."""
    listed = [(path, f.size) for path, f in m.files.items()]
    listed += [(e.path, e.size) for e in (m.v2.sealed_files() if m.v2 is not None else ())]
    bad: dict[str, str] = {}
    for path, want in listed:
        size = storage.size(path)
        if size is None:
            bad[path] = "missing"
        elif size != want:
            bad[path] = f"{size} bytes, manifest says {want} (truncated or replaced)"
    return bad


def _tensors(names: list[str], shown: int = 3) -> str:
    """``tensors 'a', 'b', 'c' and 27 more``: the tensors a damaged file holds, the first few by name."""
    listed = ", ".join(repr(n) for n in names[:shown])
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{count(len(names), 'tensor')} {listed}{more}" if len(names) > 1 else f"tensor {listed}"


def verify_checkpoint(
    reader: CheckpointReader, progress: Callable[[int], None] | None = None
) -> list[Problem]:
    """All problems found (empty when the checkpoint is intact): one per damaged file, naming what is wrong and
    the tensors it holds (a truncated file is one problem, not one per tensor in it), plus one per tensor whose
    shards do not tile it.  ``progress`` is called with bytes checked."""
    m = reader.manifest
    problems = coverage_problems(m)
    bad_files = file_problems(reader.storage, m)
    held: dict[str, list[str]] = {}  # damaged file -> the tensors stored in it
    failed: dict[str, list[tuple[str, str]]] = {}  # file -> (tensor, what reading it found)
    for name, e in m.tensors.items():
        for shard in e.shards:
            if shard.file in bad_files:
                names = held.setdefault(shard.file, [])
                if name not in names:
                    names.append(name)
                continue
            try:
                reader.read_shard(e, shard)
            except CkptError as exc:
                failed.setdefault(shard.file, []).append((name, str(exc).split(": ", 1)[-1]))
            if progress is not None:
                progress(shard.nbytes)
    for path, why in bad_files.items():
        names = held.get(path, [])
        problems.append(Problem(path, None, why + (f"; holds {_tensors(names)}" if names else "")))
    for path, found in failed.items():
        names = list(dict.fromkeys(n for n, _ in found))
        first, what = found[0]
        more = f" (also {_tensors(names[1:])})" if len(names) > 1 else ""
        problems.append(Problem(path, first, what + more))
    return problems
