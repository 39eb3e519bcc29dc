"""Where a format-2 checkpoint's tensors are: each tensor's pieces and the tables of per-rank files (docs/format.md,
"Version 2").

The top manifest of version 2 lists no chunk.  It says which rank holds each piece of every tensor once, as a regular
nested split with an affine rank formula when the sharding is regular (FSDP, HSDP, TP, ZeRO-1), or as an explicit
list of boxes otherwise (:func:`describe_boxes`), and it lists every rank's sealed index and state file with their
checksums (:class:`IndexEntry`).  This module writes and parses those members (:func:`parse_top`); the files
themselves are :mod:`ckpt.format.index`'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError
from .codecs import check_checksum_format
from .schema import JSON, Box, Shard, TensorEntry, check_relpath


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
            boxes.append((box_in(item[0], item[1], shape, f"{where} pieces.boxes[{i}]"), item[2]))
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


def box_in(offs: Any, lens: Any, shape: tuple[int, ...], where: str) -> Box:
    """The box ``offs``+``lens`` of a JSON document, refused (naming ``where``) unless it lies inside ``shape``."""
    if not (isinstance(offs, list) and isinstance(lens, list) and len(offs) == len(shape) == len(lens)):
        raise ManifestError(f"{where}: box rank does not match shape {list(shape)}")
    for v in (*offs, *lens):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ManifestError(f"{where}: expected non-negative integers, got {v!r}")
    if any(o + n > d for o, n, d in zip(offs, lens, shape, strict=True)):
        raise ManifestError(f"{where}: box {offs}+{lens} lies outside shape {list(shape)}")
    return Box(tuple(offs), tuple(lens))


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


@dataclass
class Placement:
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


def parse_top(doc: dict[str, Any], source: str) -> tuple[dict[str, Any], Placement]:
    """Check the v2-only members; return a v1-shaped document (tensors without shards) and the :class:`Placement`."""
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
    return {**doc, "tensors": v1_tensors}, Placement(pieces, indexes, states)


__all__ = [
    "IndexEntry",
    "PiecesSpec",
    "Placement",
    "blocks",
    "blocks_overlapping",
    "box_in",
    "describe_boxes",
    "describe_pieces",
    "parse_pieces",
    "parse_top",
    "split",
]
