"""Format v2: a top manifest that stays small at thousands of ranks, and sealed per-rank files (docs/format.md,
"Version 2").

v1 lists every stored chunk in ``manifest.json`` and every rank's RNG and data-loader trees: about 180 bytes per
chunk and 16 kB per rank, so an FSDP checkpoint of 8,192 ranks x 1,000 tensors is 1.5 GB of JSON that every
restoring rank parses.  v2 moves the chunks into per-rank index files (``r<rank>-<attempt>.index.json``) and the
trees into per-rank state files (``r<rank>-<attempt>.state.json``), both sealed like the manifest, their checksums
in the top manifest, and describes where each tensor's pieces are once, as a regular nested split with an affine
rank formula when the sharding is regular (FSDP, HSDP, TP, ZeRO-1), or as an explicit list of boxes otherwise.  A
restoring rank reads the top manifest, only the indexes of ranks holding pieces that overlap its boxes
(:class:`Locator`) and only its own state file; tools that want everything (``ckpt verify``, converters) load
every file into the same in-memory :class:`~ckpt.format.manifest.Manifest` as v1 (:func:`materialize`).

Writing: the training-loop saver has each rank write its own index and state file (:mod:`ckpt.format.seal`);
writers holding every shard in one process encode an in-memory manifest (:func:`encode`).  Either way both versions
hold exactly the same facts.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ManifestError
from .codecs import CODECS, check_checksum_format, check_codec
from .dtypes import itemsize
from .manifest import (
    FORMAT,
    SEAL_RE,
    Box,
    FileEntry,
    Manifest,
    Shard,
    TensorDesc,
    TensorEntry,
    check_relpath,
    manifest_doc,
    seal,
    verify_seal,
)

INDEX_FORMAT = "ckpt-index"
STATE_FORMAT = "ckpt-rank-state"

#: The format version a save or conversion writes when not told (``Checkpointer(format_version=...)``,
#: ``ckpt.format.publish.publish(..., version=...)``): the one place that decides it.  2 keeps the top manifest small at any
#: world size; 1 is still written on request and always read.
DEFAULT_FORMAT_VERSION = 2

JSON = Any


def index_name(rank: int, attempt: str) -> str:
    """The index file of ``rank`` for save attempt ``attempt`` (next to its data files)."""
    return f"r{rank:05d}-{attempt}.index.json"


# ------------------------------------------------------------------------------------------------ pieces


def split(length: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of part ``index`` of ``parts`` along a dim of ``length`` (torch.chunk / DTensor Shard)."""
    size = -(-length // parts) if parts else 0
    start = min(size * index, length)
    return start, max(0, min(size, length - start))


def blocks(shape: tuple[int, ...], levels: list[tuple[int, int]]) -> Iterator[tuple[int, Box]]:
    """Every block of a nested split, in mixed-radix order: (block index, box)."""
    yield from blocks_overlapping(shape, levels, Box.full(shape), include_empty=True)


def blocks_overlapping(
    shape: tuple[int, ...], levels: list[tuple[int, int]], want: Box, include_empty: bool = False
) -> Iterator[tuple[int, Box]]:
    """The blocks of a nested split that overlap ``want``, found by arithmetic (cost: the blocks returned)."""

    def rec(level: int, index: int, box: Box) -> Iterator[tuple[int, Box]]:
        if level == len(levels):
            if not include_empty:
                x = box.intersect(want)
                if x is None or x.numel == 0:
                    return
            yield index, box
            return
        dim, parts = levels[level]
        length = box.lengths[dim]
        size = -(-length // parts) if parts else 0
        lo = want.offsets[dim] - box.offsets[dim]
        hi = lo + want.lengths[dim]
        if include_empty or size == 0:
            first, last = 0, parts - 1
        else:
            first, last = max(0, lo // size), min(parts - 1, (hi - 1) // size)
        for i in range(first, last + 1):
            off, n = split(length, parts, i)
            if not include_empty and (n == 0 or off + n <= lo or off >= hi):
                continue
            offs = list(box.offsets)
            lens = list(box.lengths)
            offs[dim] += off
            lens[dim] = n
            yield from rec(level + 1, index * parts + i, Box(tuple(offs), tuple(lens)))

    yield from rec(0, 0, Box.full(shape))


def _block_boxes(
    shape: tuple[int, ...], levels: list[tuple[int, int]]
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, lengths) of every block of a nested split in block order (:func:`blocks`, as plain tuples;
    a single level computed directly: it is every regular tensor's of FSDP, TP and ZeRO-1)."""
    if len(levels) != 1:
        for _, b in blocks(shape, levels):
            yield b.offsets, b.lengths
        return
    d, parts = levels[0]
    head, tail = shape[:d], shape[d + 1 :]
    zeros_head, zeros_tail = (0,) * len(head), (0,) * len(tail)
    for i in range(parts):
        off, n = split(shape[d], parts, i)
        yield (*zeros_head, off, *zeros_tail), (*head, n, *tail)


def _affine(ranks: list[int], levels: list[tuple[int, int]]) -> dict[str, JSON] | None:
    """``{"start", "steps"}`` when rank = start + sum(i_l * steps[l]) over the mixed-radix digits, else None."""
    if not ranks or any(r < 0 for r in ranks):
        return None
    radices = [p for _, p in levels]
    steps = []
    stride = len(ranks)
    for p in radices:
        stride //= p
        steps.append(ranks[stride] - ranks[0] if p > 1 else 0)
    start = ranks[0]
    if len(radices) == 1:  # the common case (FSDP, TP, ZeRO-1): an arithmetic progression
        step = steps[0]
        return (
            {"start": start, "steps": steps}
            if ranks == list(range(start, start + step * len(ranks), step) if step else [start] * len(ranks))
            else None
        )
    for b, r in enumerate(ranks):
        rem, expect = b, start
        for p, s in zip(reversed(radices), reversed(steps), strict=True):
            expect += (rem % p) * s
            rem //= p
        if r != expect:
            return None
    return {"start": start, "steps": steps}


def describe_pieces(t: TensorEntry, rank_of: dict[str, int]) -> dict[str, JSON]:
    """The top-manifest ``pieces`` of a tensor held as v1 shards (the converters' path: :func:`encode`).

    Chunks of one rank make one piece (their bounding box, when they fill it); otherwise the chunks are listed.
    """
    by_rank: dict[int, list[Shard]] = {}
    for s in t.shards:
        if s.box.numel:
            by_rank.setdefault(rank_of[s.file], []).append(s)
    pieces: list[tuple[Box, int]] = []
    for r, shards in by_rank.items():
        lo = [min(s.box.offsets[d] for s in shards) for d in range(len(t.shape))]
        hi = [max(s.box.offsets[d] + s.box.lengths[d] for s in shards) for d in range(len(t.shape))]
        box = Box(tuple(lo), tuple(h - o for o, h in zip(lo, hi, strict=True)))
        if box.numel != sum(s.box.numel for s in shards):
            return {"boxes": [[list(s.box.offsets), list(s.box.lengths), rank_of[s.file]] for s in t.shards]}
        pieces.append((box, r))
    return describe_boxes(t.shape, pieces)


def describe_boxes(shape: tuple[int, ...], pieces: list[tuple[Box, int]]) -> dict[str, JSON]:
    """The top-manifest ``pieces`` of a tensor from its stored boxes, one ``(box, rank)`` per non-empty box.

    A regular nested split is looked for among the splits that the pieces' distinct offsets suggest, and kept
    only if it reproduces the pieces exactly; otherwise the pieces are listed.  Cost: a few passes over the
    tensor's pieces.
    """
    explicit = {
        "boxes": [
            [list(b.offsets), list(b.lengths), r] for b, r in sorted(pieces, key=lambda p: p[0].offsets)
        ]
    }
    if not pieces:
        return {"split": [], "ranks": [-1]}  # an empty tensor: one empty block
    at = {(b.offsets, b.lengths): r for b, r in pieces}
    if len(at) != len(pieces):
        return explicit
    varying = [d for d in range(len(shape)) if len({b.offsets[d] for b, _ in pieces}) > 1]
    counts = {d: len({b.offsets[d] for b, _ in pieces}) for d in varying}
    candidates: list[list[tuple[int, int]]] = []
    if not varying:
        candidates.append([])
    elif len(varying) == 1:
        d = varying[0]
        candidates.append([(d, counts[d])])
        candidates += [[(d, q), (d, counts[d] // q)] for q in range(2, counts[d]) if counts[d] % q == 0]
    elif len(varying) == 2:
        d1, d2 = varying
        candidates += [[(d1, counts[d1]), (d2, counts[d2])], [(d2, counts[d2]), (d1, counts[d1])]]
    for levels in candidates:
        ranks = []
        hit = 0
        for offs, lens in _block_boxes(shape, levels):
            if 0 in lens:
                ranks.append(-1)
                continue
            r = at.get((offs, lens))
            if r is None:
                break
            ranks.append(r)
            hit += 1
        else:
            if hit == len(pieces):
                aff = _affine(ranks, levels)
                return {"split": [list(lv) for lv in levels], "ranks": aff if aff is not None else ranks}
    return explicit


def _check_rank_list(spec: Any, n_blocks: int, where: str) -> tuple[int, ...]:
    """A ``ranks`` list: one rank per block, -1 for an empty block."""
    if not isinstance(spec, list) or len(spec) != n_blocks:
        raise ManifestError(
            f"{where}: 'ranks' must list {n_blocks} ranks (-1 for an empty block) or be {{start, steps}}"
        )
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= -1 for r in spec):
        raise ManifestError(f"{where}: 'ranks' must hold integers >= -1")
    return tuple(spec)


@dataclass(frozen=True)
class PiecesSpec:
    """Parsed ``pieces`` of one tensor."""

    levels: tuple[tuple[int, int], ...] | None  # None: explicit boxes
    ranks: tuple[int, ...] | None = None
    start: int = 0
    steps: tuple[int, ...] = ()
    boxes: tuple[tuple[Box, int], ...] = ()

    @property
    def count(self) -> int:
        """How many pieces are stored (blocks of an affine split counted whole: empty ones included)."""
        if self.levels is None:
            return len(self.boxes)
        if self.ranks is not None:
            return sum(1 for r in self.ranks if r >= 0)
        return math.prod(p for _, p in self.levels)

    def rank(self, block: int) -> int:
        if self.ranks is not None:
            return self.ranks[block]
        assert self.levels is not None
        r, rem = self.start, block
        for (_, p), s in zip(reversed(self.levels), reversed(self.steps), strict=True):
            r += (rem % p) * s
            rem //= p
        return r

    def ranks_for(self, shape: tuple[int, ...], want: Box) -> set[int]:
        """The ranks whose pieces overlap ``want``."""
        if self.levels is None:
            out = set()
            for b, r in self.boxes:
                inter = b.intersect(want)
                if inter is not None and inter.numel:
                    out.add(r)
            return out
        return {self.rank(i) for i, _ in blocks_overlapping(shape, list(self.levels), want)} - {-1}


def parse_pieces(spec: Any, shape: tuple[int, ...], where: str) -> PiecesSpec:
    if not isinstance(spec, dict):
        raise ManifestError(f"{where}: 'pieces' must be an object")
    if "boxes" in spec:
        boxes = []
        for i, item in enumerate(spec["boxes"] if isinstance(spec["boxes"], list) else [None]):
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[2], int)):
                raise ManifestError(f"{where}: pieces.boxes[{i}] must be [offsets, lengths, rank]")
            boxes.append((_box(item[0], item[1], shape, f"{where} pieces.boxes[{i}]"), item[2]))
        return PiecesSpec(None, boxes=tuple(boxes))
    levels_raw = spec.get("split")
    if not isinstance(levels_raw, list):
        raise ManifestError(f"{where}: 'pieces' needs 'split' or 'boxes'")
    levels = []
    for lv in levels_raw:
        if not (
            isinstance(lv, list)
            and len(lv) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in lv)
            and 0 <= lv[0] < len(shape)
            and lv[1] >= 1
        ):
            raise ManifestError(
                f"{where}: pieces.split level {lv!r} must be [dim < {len(shape)}, parts >= 1]"
            )
        levels.append((lv[0], lv[1]))
    if math.prod(p for _, p in levels) > 1 << 24:
        raise ManifestError(f"{where}: pieces.split has absurdly many blocks")
    n_blocks = math.prod(p for _, p in levels)
    ranks = spec.get("ranks")
    if isinstance(ranks, dict):
        start, steps = ranks.get("start"), ranks.get("steps")
        if not (
            isinstance(start, int)
            and isinstance(steps, list)
            and len(steps) == len(levels)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in steps)
        ):
            raise ManifestError(f"{where}: pieces.ranks must have 'start' and one step per split level")
        return PiecesSpec(tuple(levels), start=start, steps=tuple(steps))
    return PiecesSpec(tuple(levels), ranks=_check_rank_list(ranks, n_blocks, where))


def _box(offs: Any, lens: Any, shape: tuple[int, ...], where: str) -> Box:
    if not (isinstance(offs, list) and isinstance(lens, list) and len(offs) == len(shape) == len(lens)):
        raise ManifestError(f"{where}: box rank does not match shape {list(shape)}")
    for v in (*offs, *lens):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ManifestError(f"{where}: expected non-negative integers, got {v!r}")
    if any(o + n > d for o, n, d in zip(offs, lens, shape, strict=True)):
        raise ManifestError(f"{where}: box {offs}+{lens} lies outside shape {list(shape)}")
    return Box(tuple(offs), tuple(lens))


# ------------------------------------------------------------------------------------------------ writing


def state_name(rank: int, attempt: str) -> str:
    """The per-rank state file of ``rank`` (its RNG and data-loader trees) for save attempt ``attempt``."""
    return f"r{rank:05d}-{attempt}.state.json"


@dataclass(frozen=True)
class IndexEntry:
    """One sealed per-rank file the top manifest lists: an index (chunks) or a state file (RNG/data trees)."""

    path: str
    rank: int
    size: int
    checksum: str
    holds: tuple[str, ...] = ()  # state files: which trees it holds ("rng", "data")

    def to_json(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {"rank": self.rank, "size": self.size, "checksum": self.checksum}
        if self.holds:
            out["holds"] = list(self.holds)
        return out


def sealed_entry(path: str, rank: int, text: str, holds: tuple[str, ...] = ()) -> IndexEntry:
    """The table entry of a sealed file (its checksum is its seal: bytes 13..37)."""
    return IndexEntry(path, rank, len(text.encode()), text[13:37], holds)


def chunk_row(
    name: str, box: Box, file: str, offset: int, nbytes: int, codec: str, checksum: str
) -> list[JSON]:
    """One index ``chunks`` entry: ``[tensor, offsets, lengths, file, offset, nbytes, codec, checksum]``."""
    return [name, list(box.offsets), list(box.lengths), file, offset, nbytes, codec, checksum]


def index_text(rank: int, chunks: list[list[JSON]]) -> str:
    """The sealed index of ``rank``: where each of its chunks lies in its data files."""
    return seal({"format": INDEX_FORMAT, "format_version": 2, "rank": rank, "chunks": chunks})


def state_text(rank: int, rng: JSON, data: JSON) -> str:
    """The sealed state file of ``rank``: its RNG and data-loader trees (the members it has)."""
    doc: dict[str, JSON] = {"format": STATE_FORMAT, "format_version": 2, "rank": rank}
    if rng is not None:
        doc["rng"] = rng
    if data is not None:
        doc["data"] = data
    return seal(doc)


def state_holds(rng: JSON, data: JSON) -> tuple[str, ...]:
    return tuple(k for k, v in (("rng", rng), ("data", data)) if v is not None)


def top_text(
    m: Manifest, pieces: dict[str, JSON], indexes: list[IndexEntry], states: list[IndexEntry]
) -> str:
    """The sealed top manifest: ``m``'s shared members (its tensors' shards and per-rank trees are not used),
    each tensor's ``pieces``, and the tables of index and state files with their checksums."""
    doc = manifest_doc(replace(m, rng={}, data={}), version=2)
    doc["tensors"] = {n: {**_desc_json(t), "pieces": pieces[n]} for n, t in m.tensors.items()}
    doc["indexes"] = {e.path: e.to_json() for e in sorted(indexes, key=lambda e: e.rank)}
    doc["rank_state"] = {e.path: e.to_json() for e in sorted(states, key=lambda e: e.rank)}
    return seal(doc)


def encode(m: Manifest, attempt: str) -> tuple[str, dict[str, str]]:
    """(top manifest JSON, {file: JSON} of the index and state files) of an in-memory manifest ``m`` in format v2.

    The path of writers that hold every shard in one process (converters, DCP export, ``StreamingWriter``); the
    training-loop saver has each rank write its own files instead (:mod:`ckpt.format.seal`)."""
    rank_of = {p: f.rank for p, f in m.files.items()}
    chunks: dict[int, list[list[JSON]]] = {r: [] for r in set(rank_of.values())}
    for name, t in m.tensors.items():
        for s in t.shards:
            chunks[rank_of[s.file]].append(
                chunk_row(name, s.box, s.file, s.offset, s.nbytes, s.codec, s.checksum)
            )
    files: dict[str, str] = {}
    indexes, states = [], []
    for r in sorted(chunks):
        text = index_text(r, chunks[r])
        files[index_name(r, attempt)] = text
        indexes.append(sealed_entry(index_name(r, attempt), r, text))
    for key in sorted({int(k) for k in m.rng} | {int(k) for k in m.data}):
        rng, data = m.rng.get(str(key)), m.data.get(str(key))
        text = state_text(key, rng, data)
        files[state_name(key, attempt)] = text
        states.append(sealed_entry(state_name(key, attempt), key, text, state_holds(rng, data)))
    pieces = {n: describe_pieces(t, rank_of) for n, t in m.tensors.items()}
    return top_text(m, pieces, indexes, states), files


def _desc_json(t: TensorDesc) -> dict[str, JSON]:
    out: dict[str, JSON] = {"role": t.role, "shape": list(t.shape), "dtype": t.dtype}
    for k in ("param", "key", "partition"):
        if getattr(t, k) is not None:
            out[k] = getattr(t, k)
    return out


# ------------------------------------------------------------------------------------------------ reading


@dataclass
class Layout2:
    """What a v2 top manifest says beyond v1's fields: pieces per tensor and the tables of per-rank files."""

    pieces: dict[str, PiecesSpec]
    indexes: dict[int, IndexEntry]
    states: dict[int, IndexEntry] = field(default_factory=dict)
    loaded: dict[int, dict[str, Any]] = field(default_factory=dict)

    def sealed_files(self) -> list[IndexEntry]:
        """Every index and state file the top manifest lists (retention keeps them, ``ckpt ls`` stats them)."""
        return [*self.indexes.values(), *self.states.values()]


def _parse_table(doc: dict[str, Any], key: str, source: str) -> dict[int, IndexEntry]:
    table = doc.get(key)
    if not isinstance(table, dict):
        hint = (
            " (a draft of format 2 written before the per-rank state files: re-save it, or convert it with the "
            "ckpt that wrote it)"
            if key == "rank_state" and "indexes" in doc
            else ""
        )
        raise ManifestError(f"{source}: field {key!r} must be an object (format_version 2){hint}")
    out: dict[int, IndexEntry] = {}
    for path, e in table.items():
        where = f"{source}: {key}[{path!r}]"
        check_relpath(path, where)
        if not isinstance(e, dict):
            raise ManifestError(f"{where}: expected an object")
        rank, size, csum = e.get("rank"), e.get("size"), e.get("checksum")
        for k, v in (("rank", rank), ("size", size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ManifestError(f"{where}.{k}: expected a non-negative integer, got {v!r}")
        if not isinstance(csum, str):
            raise ManifestError(f"{where}.checksum: expected a string")
        try:
            check_checksum_format(csum)
        except ManifestError as exc:
            raise ManifestError(f"{where}: {exc}") from None
        holds: tuple[str, ...] = ()
        if key == "rank_state":
            h = e.get("holds")
            if not (
                isinstance(h, list) and h and all(x in ("rng", "data") for x in h) and len(set(h)) == len(h)
            ):
                raise ManifestError(f"{where}.holds: expected a non-empty list of 'rng', 'data'")
            holds = tuple(h)
        if rank in out:
            raise ManifestError(f"{where}: rank {rank} is listed twice")
        out[rank] = IndexEntry(path, rank, size, csum, holds)
    return out


def parse_top(doc: dict[str, Any], source: str) -> tuple[dict[str, Any], Layout2]:
    """Check the v2-only members; return a v1-shaped document (tensors without shards) and the :class:`Layout2`."""
    indexes = _parse_table(doc, "indexes", source)
    states = _parse_table(doc, "rank_state", source)
    for key in ("rng", "data"):
        if doc.get(key, {}) != {}:
            raise ManifestError(
                f"{source}: field {key!r} must be {{}} in format_version 2 (per-rank trees are in state files)"
            )
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict):
        raise ManifestError(f"{source}: missing field 'tensors'")
    pieces: dict[str, PiecesSpec] = {}
    v1_tensors = {}
    for name, t in tensors.items():
        where = f"{source}: tensor {name!r}"
        if not isinstance(t, dict):
            raise ManifestError(f"{where}: expected an object")
        if "shards" in t:
            raise ManifestError(
                f"{where}: 'shards' is not a format_version 2 member (they are in the indexes)"
            )
        shape = t.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ManifestError(f"{where}: field 'shape' must be a list of non-negative integers")
        spec = parse_pieces(t.get("pieces"), tuple(shape), where)
        for r in spec.ranks or ():
            if r >= 0 and r not in indexes:
                raise ManifestError(f"{where}: pieces name rank {r}, which has no index")
        for _, r in spec.boxes:
            if r not in indexes:
                raise ManifestError(f"{where}: pieces name rank {r}, which has no index")
        pieces[name] = spec
        v1_tensors[name] = {k: v for k, v in t.items() if k != "pieces"} | {"shards": []}
    return {**doc, "tensors": v1_tensors}, Layout2(pieces, indexes, states)


def load_sealed(storage: Any, e: IndexEntry, source: str, fmt: str, what: str) -> dict[str, Any]:
    """Read, verify (its seal and the checksum the top manifest holds for it) and parse one per-rank file."""
    where = storage.display(e.path)
    try:
        raw = storage.read_bytes(e.path)
    except FileNotFoundError:
        raise ManifestError(f"{where}: missing ({what} of rank {e.rank}, listed in {source})") from None
    m = SEAL_RE.match(raw)
    if m is None or m.group(1).decode() != e.checksum:
        raise ManifestError(
            f"{where} is damaged or replaced: its checksum is not {e.checksum} (as {source} records)"
        )
    verify_seal(raw, where)
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt or doc.get("rank") != e.rank:
        raise ManifestError(f"{where}: not the ckpt {what} of rank {e.rank}")
    return doc


def load_index(storage: Any, e: IndexEntry, source: str) -> dict[str, Any]:
    """One rank's index, verified (:func:`load_sealed`)."""
    doc = load_sealed(storage, e, source, INDEX_FORMAT, "index")
    if not isinstance(doc.get("chunks"), list):
        raise ManifestError(f"{storage.display(e.path)}: field 'chunks' must be a list")
    return doc


def load_state(storage: Any, e: IndexEntry, source: str) -> tuple[Any, Any]:
    """(rng, data) trees of one rank's state file, verified; each must be present iff its entry says it holds it."""
    doc = load_sealed(storage, e, source, STATE_FORMAT, "state file")
    for k in ("rng", "data"):
        if (k in doc) != (k in e.holds):
            raise ManifestError(
                f"{storage.display(e.path)}: member {k!r} {'missing' if k in e.holds else 'unexpected'} "
                f"({source} lists it as holding {', '.join(e.holds)})"
            )
    return doc.get("rng"), doc.get("data")


_CHECKSUM_RE = re.compile(r"xxh3_64:[0-9a-f]{16}")


def index_shards(
    doc: dict[str, Any], tensors: dict[str, TensorEntry], files: dict[str, FileEntry], where: str
) -> dict[str, list[Shard]]:
    """The chunks of one index, validated like v1 shards (box inside the tensor, bytes inside the file).

    A restoring DDP rank reads every rank's index, so the common case is checked inline on plain values; any
    chunk that fails it goes through :func:`_check_chunk`, which names what is wrong.  A chunk's file needs no
    path check of its own: it must be a key of ``files``, whose names the top manifest's parse checked."""
    out: dict[str, list[Shard]] = {}
    sizes: dict[str, int] = {}
    for i, c in enumerate(doc["chunks"]):
        try:
            name, offs, lens, file, offset, nbytes, codec, csum = c
            shape = tensors[name].shape
            ok = (
                type(offs) is list
                and type(lens) is list
                and len(offs) == len(shape) == len(lens)
                and type(offset) is int
                and type(nbytes) is int
                and offset >= 0
                and nbytes >= 0
                and codec in CODECS
                and type(csum) is str
                and (not csum or _CHECKSUM_RE.fullmatch(csum) is not None)
                and offset + nbytes <= files[file].size
            )
            numel = 1
            if ok:
                for o, n, d in zip(offs, lens, shape):  # noqa: B905 - lengths checked just above
                    if type(o) is not int or type(n) is not int or o < 0 or n < 0 or o + n > d:
                        ok = False
                        break
                    numel *= n
            if name not in sizes:
                sizes[name] = itemsize(tensors[name].dtype)
            ok = ok and (codec != "raw" or nbytes == numel * sizes[name])
        except (TypeError, ValueError, KeyError):
            ok = False
        if not ok:
            _check_chunk(c, tensors, files, f"{where} chunk {i}")
            raise AssertionError(f"{where} chunk {i}: refused by the fast check only")  # pragma: no cover
        out.setdefault(name, []).append(
            Shard(file, offset, nbytes, Box(tuple(offs), tuple(lens)), codec, csum)
        )
    return out


def _check_chunk(c: Any, tensors: dict[str, TensorEntry], files: dict[str, FileEntry], cw: str) -> None:
    """Raise the one-line error that says what is wrong with index chunk ``c``."""
    if not (isinstance(c, list) and len(c) == 8 and isinstance(c[0], str)):
        raise ManifestError(
            f"{cw}: expected [tensor, offsets, lengths, file, offset, nbytes, codec, checksum]"
        )
    name, offs, lens, file, offset, nbytes, codec, csum = c
    t = tensors.get(name)
    if t is None:
        raise ManifestError(f"{cw}: tensor {name!r} is not in the manifest")
    box = _box(offs, lens, t.shape, cw)
    if not isinstance(file, str):
        raise ManifestError(f"{cw}: file must be a string, got {file!r}")
    check_relpath(file, cw)
    if file not in files:
        raise ManifestError(f"{cw}: file {file!r} is not listed in 'files'")
    for v in (offset, nbytes):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ManifestError(f"{cw}: expected a non-negative integer, got {v!r}")
    try:
        check_codec(codec)
        if not isinstance(csum, str):
            raise ManifestError("checksum must be a string")
        if csum:
            check_checksum_format(csum)
    except ManifestError as exc:
        raise ManifestError(f"{cw}: {exc}") from None
    if codec == "raw" and nbytes != box.numel * itemsize(t.dtype):
        raise ManifestError(
            f"{cw}: nbytes {nbytes} does not match its box ({box.numel * itemsize(t.dtype)} bytes)"
        )
    if offset + nbytes > files[file].size:
        raise ManifestError(
            f"{cw}: bytes {offset}..{offset + nbytes} lie outside {file} ({files[file].size} bytes)"
        )


class Locator:
    """Lazy shard lookup for one v2 checkpoint: reads an index the first time a box needs one of its chunks."""

    def __init__(self, storage: Any, manifest: Manifest, layout: Layout2, source: str) -> None:
        self.storage, self.manifest, self.layout, self.source = storage, manifest, layout, source
        self._chunks: dict[int, dict[str, list[Shard]]] = {}
        self._trees: dict[int, tuple[Any, Any]] = {}

    def rank_index(self, rank: int) -> dict[str, list[Shard]]:
        if rank not in self.layout.indexes:
            raise ManifestError(f"{self.source}: pieces name rank {rank}, which has no index")
        if rank not in self._chunks:
            e = self.layout.indexes[rank]
            doc = load_index(self.storage, e, self.source)
            self.layout.loaded[rank] = doc
            self._chunks[rank] = index_shards(
                doc, self.manifest.tensors, self.manifest.files, self.storage.display(e.path)
            )
        return self._chunks[rank]

    def shards(self, name: str, want: Box) -> list[Shard]:
        t = self.manifest.tensors[name]
        spec = self.layout.pieces[name]
        out: list[Shard] = []
        for r in sorted(spec.ranks_for(t.shape, want)):
            out.extend(self.rank_index(r).get(name, ()))
        return out

    def trees(self, kind: str) -> Mapping[str, Any]:
        """Every rank's ``rng`` or ``data`` tree as a mapping that reads a rank's state file only when that rank's
        tree is looked up (keys: the ranks whose state file holds that kind of tree: no file read to list them)."""
        ranks = [r for r, e in sorted(self.layout.states.items()) if kind in e.holds]
        return _LazyTrees(self, kind, ranks) if ranks else {}

    def rank_trees(self, rank: int) -> tuple[Any, Any]:
        """(rng, data) trees of ``rank`` (None where absent or when the rank has no state file)."""
        e = self.layout.states.get(rank)
        if e is None:
            return None, None
        if rank not in self._trees:
            self._trees[rank] = load_state(self.storage, e, self.source)
        return self._trees[rank]


class _LazyTrees(Mapping[str, Any]):
    def __init__(self, locator: Locator, kind: str, ranks: list[int]) -> None:
        self.locator, self.kind = locator, kind
        self.keys_ = [str(r) for r in ranks]
        self._keys = set(self.keys_)

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return self.locator.rank_trees(int(key))[0 if self.kind == "rng" else 1]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)


def materialize(storage: Any, m: Manifest, layout: Layout2, source: str) -> Manifest:
    """The full in-memory manifest (every index and state file read): what v1 would have parsed."""
    loc = Locator(storage, m, layout, source)
    shards: dict[str, list[Shard]] = {n: [] for n in m.tensors}
    for r in sorted(layout.indexes):
        for n, ss in loc.rank_index(r).items():
            shards[n].extend(ss)
    rng: dict[str, Any] = {}
    data: dict[str, Any] = {}
    for r in sorted(layout.states):
        rt, dt = loc.rank_trees(r)
        if rt is not None:
            rng[str(r)] = rt
        if dt is not None:
            data[str(r)] = dt
    tensors = {
        n: TensorEntry.of(t.desc, tuple(sorted(shards[n], key=lambda s: s.box.offsets)))
        for n, t in m.tensors.items()
    }
    return replace(m, tensors=tensors, rng=rng, data=data)


__all__ = [
    "DEFAULT_FORMAT_VERSION",
    "FORMAT",
    "encode",
    "index_name",
    "state_name",
    "Locator",
    "materialize",
    "parse_top",
    "describe_boxes",
    "describe_pieces",
]
