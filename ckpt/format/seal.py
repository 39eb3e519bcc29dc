"""The format v2 commit of the training-loop saver: each writer seals its own files, rank 0 checks pieces.

With format v1 (and with :func:`ckpt.format.index.encode`) rank 0 receives every rank's receipt, one entry per
chunk, validates them chunk by chunk and serialises them all: O(N x T) work and bytes on one rank.  Here:

1. every writer, after publishing its data file, writes its index (its chunks: where each lies, its checksum) and
   its state file (its RNG and data-loader trees), both sealed and create-only (:func:`write_rank_files`);
2. it sends rank 0 a :class:`RankSummary`: its data files' sizes, the two files' checksums and the boxes it
   wrote (one per tensor it writes, before chunking: T per rank at most);
3. rank 0 checks that the boxes tile every tensor (:func:`build_top`, the same rules as
   ``ckpt.format.publish.build_manifest`` applies to chunks), describes each tensor's pieces and writes the top manifest,
   which seals every index's and state file's checksum.

A writer's chunks lie inside the box it reports by construction (``ckpt.saving.planning.chunk_boxes``), and their byte
ranges inside its file (it just wrote them); readers validate both again when they read an index.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..storage import Storage
from .index import (
    IndexEntry,
    chunk_row,
    describe_boxes,
    index_name,
    index_text,
    sealed_entry,
    state_holds,
    state_name,
    state_text,
    top_text,
)
from .manifest import Box, FileEntry, Layout, TensorDesc, TensorEntry
from .publish import Receipt, check_box, check_covered, manifest_of


@dataclass
class RankSummary:
    """What a writer sends rank 0 under format v2 (independent of how many chunks it wrote)."""

    rank: int
    files: list[tuple[str, int]] = field(default_factory=list)
    pieces: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    index: IndexEntry | None = None
    state: IndexEntry | None = None


def write_rank_files(
    storage: Storage,
    receipt: Receipt,
    attempt: str,
    pieces: Iterable[tuple[str, Box]],
    rng: Any = None,
    data: Any = None,
) -> RankSummary:
    """Writer side (every rank, after its data file): publish this rank's index and state file create-only and
    return what rank 0 needs of them.  Nothing is written for a rank with no chunk (index) or no tree (state)."""
    rank = receipt.rank
    out = RankSummary(rank, list(receipt.files), [(n, b.offsets, b.lengths) for n, b in pieces])
    if receipt.shards:
        rows = [
            chunk_row(name, Box(tuple(offs), tuple(lens)), f, off, nbytes, codec, csum)
            for name, offs, lens, f, off, nbytes, codec, csum in receipt.shards
        ]
        text = index_text(rank, rows)
        storage.put_bytes(index_name(rank, attempt), text.encode(), exclusive=True)
        out.index = sealed_entry(index_name(rank, attempt), rank, text)
    if rng is not None or data is not None:
        text = state_text(rank, rng, data)
        storage.put_bytes(state_name(rank, attempt), text.encode(), exclusive=True)
        out.state = sealed_entry(state_name(rank, attempt), rank, text, state_holds(rng, data))
    return out


def build_top(
    *,
    step: int,
    backend: str,
    layout: Layout,
    metas: list[TensorDesc],
    summaries: Iterable[RankSummary],
    trees: dict[str, Any],
    env: dict[str, Any] | None = None,
) -> tuple[str, int]:
    """Rank 0: (sealed top manifest, bytes of data) from every writer's summary, after checking that the written
    boxes tile every tensor exactly once (a writer bug is refused before anything is committed)."""
    by_name = {m.name: m for m in metas}
    boxes: dict[str, list[tuple[Box, int]]] = {n: [] for n in by_name}
    seen: set[Any] = set()
    files: dict[str, FileEntry] = {}
    indexes: list[IndexEntry] = []
    states: list[IndexEntry] = []
    for s in summaries:
        for fname, size in s.files:
            files[fname] = FileEntry(fname, size, s.rank)
        for name, offs, lens in s.pieces:
            box = check_box(s.rank, name, offs, lens, by_name, seen)
            if box.numel:
                boxes[name].append((box, s.rank))
        if s.index is not None:
            indexes.append(s.index)
        if s.state is not None:
            states.append(s.state)
    pieces = {}
    for n, d in by_name.items():
        check_covered(n, d.shape, sum(b.numel for b, _ in boxes[n]))
        pieces[n] = describe_boxes(d.shape, boxes[n])
    m = manifest_of(
        step=step,
        backend=backend,
        layout=layout,
        tensors={n: TensorEntry.of(d, ()) for n, d in by_name.items()},
        files=files,
        trees=trees,
        rng={},
        data={},
        env=env,
    )
    return top_text(m, pieces, indexes, states), m.total_bytes


__all__ = ["RankSummary", "build_top", "write_rank_files"]
