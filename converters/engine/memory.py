"""How much memory a conversion holds, estimated from the plan the executor runs (``--dry-run``).

The estimate is of *anonymous* memory (what the process itself allocates: the page cache and memory-mapped source
files are the kernel's to reclaim) on top of the interpreter with torch imported, and it follows the executor's
mechanism step by step, so a change there shows up here:

* reading a piece costs what the source allocates for it (:meth:`~.source.Source.read_anon`: nothing for a view of
  a memory-mapped file, the piece for a fresh read, a whole tensor merged over DP for a ZeRO-1 state);
* a part made of several pieces is allocated once and the pieces are copied in one at a time
  (:func:`~.execute.assemble`); replica variants are read again to be compared;
* what the part leaves behind for the writer (``retained``) is its bytes unless it is a view of a mapped file;
* only the tensors the export writes count (an HF target drops the optimizer the plan carries);
* the source keeps some tensors between parts (:meth:`~.source.Source.cache_bytes`), and the target format holds
  its own buffers (``held_bytes`` of the export: our writer's two batches, one NxD rank, a DCP item being
  serialised).

``tests/test_convert_memory.py`` checks the estimate against the measured peak ``RssAnon`` of every source x
target pair (within 2x).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpt.layouts import Piece

from .plan import Conversion, OutPart
from .source import Source


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak anonymous memory of one worker, in bytes, by where it goes (``total`` is what ``--dry-run`` prints)."""

    part: int  # the largest working set of making one target part (reads, assembly, replica comparison)
    source: int  # what the source keeps between parts (its caches)
    export: int  # what the target format holds while parts stream through (buffers, one NxD rank)

    @property
    def total(self) -> int:
        return self.part + self.source + self.export


def _contiguous(p: Piece) -> bool:
    """A slice along dim 0 (or no slice) of a contiguous tensor is contiguous; along another dim it is not."""
    return p.dim is None or p.dim == 0


def part_cost(source: Source, part: OutPart) -> tuple[int, int]:
    """``(working, retained)``: the peak anonymous bytes while ``part`` is made, and what stays allocated for the
    writer once it is (0 for a view of a memory-mapped source)."""
    pieces = part.plan.pieces
    reads = [source.read_anon(p) for p in pieces]
    if len(pieces) == 1:
        working = reads[0]
        # a fresh read is the part's own bytes; a view of a mapped file is none until the writer copies a strided one
        retained = part.nbytes if reads[0] or not _contiguous(pieces[0]) else 0
    else:
        working = part.nbytes + max(reads)  # the part, and one piece being copied into it
        retained = part.nbytes
    for variant in part.plan.replicas:
        again = [source.read_anon(p) for p in variant]
        extra = part.nbytes + max(again) if len(variant) > 1 and part.plan.dim is None else max(again)
        working = max(working, retained + extra)
    return max(working, retained), retained


def estimate(conv: Conversion, export: Any = None) -> MemoryEstimate:
    """The peak anonymous memory of running ``conv`` into ``export`` in one worker (see the module docstring)."""
    source = conv.source
    # an export that writes only some of the plan's tensors (HF: the model, not the optimizer) names them in ``outs``
    written = getattr(export, "outs", None)
    tensors = [t for t in conv.tensors if written is None or t.desc.name in written]
    worst, retained = 0, {}
    for t in tensors:
        for part in t.parts:
            working, kept = part_cost(source, part)
            worst = max(worst, working)
            retained[id(part)] = kept
    held: Callable[[Callable[[OutPart], int]], int] | None = getattr(export, "held_bytes", None)
    hold = held(lambda p: retained.get(id(p), 0)) if held is not None else 0
    pieces = (
        p for t in tensors for part in t.parts for v in (part.plan.pieces, *part.plan.replicas) for p in v
    )
    return MemoryEstimate(worst, source.cache_bytes(pieces), hold)


__all__ = ["MemoryEstimate", "estimate", "part_cost"]
