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


def verify_checkpoint(
    reader: CheckpointReader, progress: Callable[[int], None] | None = None
) -> list[Problem]:
    """All problems found (empty when the checkpoint is intact). ``progress`` is called with bytes checked."""
    m = reader.manifest
    problems = coverage_problems(m)
    bad_files: set[str] = set()
    for path, f in m.files.items():
        size = reader.storage.size(path)
        if size is None:
            problems.append(Problem(path, None, "missing"))
            bad_files.add(path)
        elif size != f.size:
            problems.append(
                Problem(path, None, f"{size} bytes, manifest says {f.size} (truncated or replaced)")
            )
            bad_files.add(path)
    for name, e in m.tensors.items():
        for shard in e.shards:
            if shard.file in bad_files:
                problems.append(Problem(shard.file, name, "stored in a missing or damaged file"))
                continue
            try:
                reader.read_shard(e, shard)
            except CkptError as exc:
                problems.append(Problem(shard.file, name, str(exc).split(": ", 1)[-1]))
            if progress is not None:
                progress(shard.nbytes)
    return problems
