"""The commit step, shared by the training-loop saver, the streaming writer and the converters: what ranks wrote
becomes a manifest, and :func:`publish` writes it, the one commit point of every checkpoint ckpt writes.

Two ways to get there, with the same checks (every written box lies inside its tensor, none is written twice, the
boxes hold as many elements as the tensor: a writer bug is refused before anything is committed):

* from every chunk (:class:`Receipt`, :func:`build_manifest`): one process holds every shard's place (converters,
  DCP export, ``StreamingWriter``, the saver's format 1).  :func:`publish` writes format 2's per-rank index and state
  files itself (:func:`ckpt.format.index.encode`), then the manifest;
* from every writer's summary (format 2 in the training-loop saver): each writer, after publishing its data file,
  writes its own sealed index and state file (:func:`write_rank_files`) and sends rank 0 a :class:`RankSummary`
  (its files' sizes and checksums, and the boxes it wrote before chunking: T per rank at most, independent of the
  chunk count); rank 0 checks the boxes (:func:`manifest_from_summaries`) and :func:`publish` writes the top
  manifest that seals every index's and state file's checksum.

A writer's chunks lie inside the box it reports by construction (``ckpt.saving.planning.chunk_boxes``), and their
byte ranges inside its file (it just wrote them); readers validate both again when they read an index.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..storage import Storage
from . import environment
from .index import (
    chunk_row,
    encode,
    index_name,
    index_text,
    sealed_entry,
    state_holds,
    state_name,
    state_text,
    top_text,
)
from .manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, tree_members
from .placement import IndexEntry
from .schema import Box, FileEntry, Layout, Shard, TensorDesc, TensorEntry
from .tiling import PackedBoxes, Piece, check_box, check_covered, tile


@dataclass
class Receipt:
    """What one rank wrote: its files and, per chunk, (name, offsets, lengths, file, offset, nbytes, codec, checksum)."""

    rank: int
    files: list[tuple[str, int]] = field(default_factory=list)
    shards: list[tuple[str, tuple[int, ...], tuple[int, ...], str, int, int, str, str]] = field(
        default_factory=list
    )


def data_file_name(rank: int, attempt: str, seq: int | None = None) -> str:
    """The name of a data file (docs/format.md): ``r<rank>-<attempt>[-<seq>].safetensors``; the attempt id makes a
    failed attempt's files findable and two attempts' files distinct."""
    tail = "" if seq is None else f"-{seq:05d}"
    return f"r{rank:05d}-{attempt}{tail}.safetensors"


# a writer that serves a data file elsewhere (ckpt.saving.process_writer): given the storage, file name, chunk keys,
# chunks and header metadata, it writes the file and returns ((offset, nbytes, checksum) of each chunk, file size),
# or None when it cannot serve this file (then it is written here)
WriteElsewhere = Callable[
    [Storage, str, list[str], Sequence[tuple[str, Box, Any]], dict[str, str]],
    "tuple[list[tuple[int, int, str]], int] | None",
]


def data_file_metadata(step: int, rank: int) -> dict[str, str]:
    """The header metadata of a training-loop save's data file (besides ``format``)."""
    return {"step": str(step), "rank": str(rank)}


def chunk_keys(chunks: Sequence[tuple[str, Box, Any]]) -> list[str]:
    """The data-file keys of ``(tensor name, box, tensor)`` chunks: ``<name>@<offsets>``."""
    return [f"{name}@{','.join(map(str, box.offsets))}" for name, box, _ in chunks]


def payload_offsets(
    chunks: Sequence[tuple[str, Box, Any]], metadata: dict[str, str] | None = None
) -> list[int]:
    """Where each chunk's bytes will start in the uncompressed data file :func:`write_data_file` writes of
    ``chunks`` (shapes and dtypes are all it reads: the tensors may still be on their device).  A stager lays its
    arena out by them, so that the file can be written from it with direct I/O."""
    from .datafile import Chunk, raw_entry
    from .streamwrite import safetensors_header

    entries = [raw_entry(Chunk(k, t)) for k, (_, _, t) in zip(chunk_keys(chunks), chunks, strict=True)]
    pos = len(safetensors_header(entries, {"format": "ckpt", **(metadata or {})}))
    out = []
    for e in entries:
        out.append(pos)
        pos += e[3]
    return out


def write_data_file(
    storage: Storage,
    receipt: Receipt,
    fname: str,
    chunks: Sequence[tuple[str, Box, Any]],
    codec: str,
    metadata: dict[str, str] | None = None,
    elsewhere: WriteElsewhere | None = None,
) -> int:
    """Write ``(tensor name, box, host tensor)`` chunks as data file ``fname`` (published whole) and record it and
    every chunk in ``receipt``; returns the file size.  Chunk keys are ``<name>@<offsets>``.  ``elsewhere``: a
    writer to try first (uncompressed files only)."""
    from .datafile import Chunk, write_shard_file

    keys = chunk_keys(chunks)
    meta = {"format": "ckpt", **(metadata or {})}
    served = (
        elsewhere(storage, fname, keys, chunks, meta) if elsewhere is not None and codec == "raw" else None
    )
    if served is not None:
        placed, size = served
    else:
        # the chunks are staged host tensors that stay unchanged until the file is published: lend them to the
        # storage (S3 builds its upload parts straight from them)
        with storage.create(fname, borrow=True) as f:
            written, size = write_shard_file(
                f, [Chunk(k, t, codec) for k, (_, _, t) in zip(keys, chunks, strict=True)], metadata
            )
        placed = [(w.offset, w.nbytes, w.checksum) for w in written]
    receipt.files.append((fname, size))
    receipt.shards.extend(
        (name, box.offsets, box.lengths, fname, offset, nbytes, codec, digest)
        for (name, box, _), (offset, nbytes, digest) in zip(chunks, placed, strict=True)
    )
    return size


def build_manifest(
    *,
    step: int,
    backend: str,
    layout: Layout,
    metas: Iterable[TensorDesc],
    receipts: Iterable[Receipt],
    trees: dict[str, Any],
    rank_trees: dict[int, dict[str, Any]] | None = None,
    env: dict[str, Any] | None = None,
) -> Manifest:
    """Assemble the manifest; every tensor must be covered by the receipts' shards.

    Checked here, in time linear in the shards, so that a writer bug is refused before anything is committed:
    every shard's box lies inside its tensor, no box was written twice, and the boxes hold as many elements as
    the tensor (together: no gap, unless boxes overlap partially, which ``ckpt verify`` detects).
    """
    metas_by_name = {m.name: m for m in metas}
    shards: dict[str, list[Shard]] = {n: [] for n in metas_by_name}
    seen: set[Any] = set()
    files: dict[str, FileEntry] = {}
    for r in receipts:
        for fname, size in r.files:
            files[fname] = FileEntry(fname, size, r.rank)
        for name, offs, lens, fname, off, nbytes, codec, csum in r.shards:
            box = check_box(r.rank, name, offs, lens, metas_by_name, seen)
            shards[name].append(Shard(fname, off, nbytes, box, codec, csum))
    tensors = {}
    for n, m in metas_by_name.items():
        check_covered(n, m.shape, sum(s.box.numel for s in shards[n]))
        tensors[n] = TensorEntry.of(m, tuple(sorted(shards[n], key=lambda s: s.box.offsets)))
    rank_trees = rank_trees or {}
    rng = {str(r): t["rng"] for r, t in sorted(rank_trees.items()) if "rng" in t} or trees.get("rng", {})
    data = {str(r): t["data"] for r, t in sorted(rank_trees.items()) if "data" in t} or trees.get("data", {})
    return Manifest(
        step, _now(), backend, layout, tensors, files, **_commit_members(step, layout, trees, rng, data, env)
    )


@dataclass
class RankSummary:
    """What a writer sends rank 0 under format v2 (independent of how many chunks it wrote).  ``pieces``: the
    boxes it wrote, ``(tensor name, offsets, lengths)``, packed (:class:`~ckpt.format.tiling.PackedBoxes`, as
    :func:`write_rank_files` makes them) or as a list."""

    rank: int
    files: list[tuple[str, int]] = field(default_factory=list)
    pieces: PackedBoxes | list[Piece] = field(default_factory=PackedBoxes)
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
    out = RankSummary(rank, list(receipt.files), PackedBoxes((n, b.offsets, b.lengths) for n, b in pieces))
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


@dataclass(frozen=True)
class RankFiles:
    """The per-rank files the writers already published (format 2 saver): each tensor's ``pieces`` as the top
    manifest describes them, and the tables of index and state files with their checksums."""

    pieces: dict[str, Any]
    indexes: list[IndexEntry]
    states: list[IndexEntry]


def manifest_from_summaries(
    *,
    step: int,
    backend: str,
    layout: Layout,
    metas: list[TensorDesc],
    summaries: Iterable[RankSummary],
    trees: dict[str, Any],
    env: dict[str, Any] | None = None,
) -> tuple[Manifest, RankFiles]:
    """Rank 0: the manifest (no shards: they are in the indexes) and the writers' files from every writer's
    summary, after checking that the written boxes tile every tensor exactly once.  Publish both with
    :func:`publish`."""
    by_name = {m.name: m for m in metas}
    files: dict[str, FileEntry] = {}
    indexes: list[IndexEntry] = []
    states: list[IndexEntry] = []
    written = []
    for s in summaries:
        for fname, size in s.files:
            files[fname] = FileEntry(fname, size, s.rank)
        written.append((s.rank, s.pieces))
        if s.index is not None:
            indexes.append(s.index)
        if s.state is not None:
            states.append(s.state)
    pieces = tile(by_name, written)
    tensors = {n: TensorEntry.of(d, ()) for n, d in by_name.items()}
    m = Manifest(
        step, _now(), backend, layout, tensors, files, **_commit_members(step, layout, trees, {}, {}, env)
    )
    return m, RankFiles(pieces, indexes, states)


def _now() -> str:
    """A commit's time stamp (the manifest's ``created_at``)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _commit_members(
    step: int,
    layout: Layout,
    trees: dict[str, Any],
    rng: dict[str, Any],
    data: dict[str, Any],
    env: dict | None,
) -> dict[str, Any]:
    """The members of a commit's manifest besides its head: the trees as the writer captured them, the per-rank
    trees, and the environment (taken now unless ``env`` is given)."""
    return {
        **tree_members(trees),
        "rng": rng,
        "progress": trees.get("progress", {"step": step}),
        "data": data,
        "environment": env if env is not None else environment.capture(layout.world_size),
        "extra": trees.get("extra", {}),
        "run_id": trees.get("run_id"),
    }


def publish(
    storage: Storage, manifest: Manifest, version: int | None = None, written: RankFiles | None = None
) -> None:
    """Write ``manifest`` create-only: the commit point, the one writer of ``manifest.json``.

    ``version`` (default :data:`~ckpt.format.schema.FORMAT_VERSION`) 1: the whole manifest.  2: the top manifest,
    after each rank's index and state file: the ones the writers already published (``written``, from
    :func:`manifest_from_summaries`), else written here first, create-only, named after the save attempt of the
    data files (:func:`ckpt.format.index.encode`)."""
    version = FORMAT_VERSION if version is None else version
    if version == 1:
        if written is not None:
            raise ValueError("format 1 has no per-rank files: publish its manifest alone")
        text = manifest.to_json()
    elif written is not None:
        text = top_text(manifest, written.pieces, written.indexes, written.states)
    else:
        attempts = {p.split("-")[1].split(".")[0] for p in manifest.files if p.startswith("r") and "-" in p}
        attempt = sorted(attempts)[0] if len(attempts) == 1 else uuid.uuid4().hex[:8]
        text, indexes = encode(manifest, attempt)
        for path, index in indexes.items():
            storage.put_bytes(path, index.encode(), exclusive=True)
    storage.put_bytes(MANIFEST_NAME, text.encode(), exclusive=True)


__all__ = [
    "RankFiles",
    "RankSummary",
    "Receipt",
    "build_manifest",
    "check_box",
    "check_covered",
    "data_file_name",
    "manifest_from_summaries",
    "publish",
    "write_data_file",
    "write_rank_files",
]
