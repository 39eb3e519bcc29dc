"""Rank 0's half of a format-2 commit: check that the boxes every writer wrote tile every tensor exactly once, and
say where each tensor's pieces are (the top manifest's ``pieces``, :func:`ckpt.format.placement.describe_boxes`).

An FSDP save of 8,192 ranks x 1,000 tensors hands rank 0 8.2 M boxes (every rank writes a box of every tensor).
Checked one box at a time in Python that is ~5 us a box, ~40 s of rank 0's commit.  So writers send their boxes
packed (:class:`PackedBoxes`: the names as one string, the coordinates as one int64 array; pickled as a few byte
strings, not as millions of tuples), and rank 0 checks and describes them with array operations
(:func:`tile`): the same checks as :func:`check_box` and :func:`check_covered`, and the same ``pieces`` as ``describe_boxes`` for the shapes it
recognizes in one pass (one piece holding the whole tensor; one regular split along one dim, FSDP / TP / ZeRO-1 /
an HSDP shard group).  Every other tensor is described by ``describe_boxes`` itself, on its own pieces.  When any
check fails, :func:`tile_one_by_one` (the per-box path, kept as the reference) runs instead and names the first
bad box, exactly as before.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, islice
from typing import Any

from ..errors import ManifestError
from .placement import describe_boxes
from .schema import JSON, Box, TensorDesc

Piece = tuple[str, tuple[int, ...], tuple[int, ...]]


class PackedBoxes:
    """A writer's boxes ``(tensor name, offsets, lengths)``, packed: all names in one string (with their lengths),
    the offsets and lengths of every box in one int64 array (with each box's number of dims).  Iterating yields the
    boxes as tuples again; :func:`tile` reads the arrays."""

    __slots__ = ("coords", "name_lens", "names", "ndims")

    def __init__(self, pieces: Iterable[Piece] = ()) -> None:
        items = list(pieces)
        self.names = "".join(n for n, _, _ in items)
        self.name_lens = _narrow([len(n) for n, _, _ in items], "I")
        # per box: the number of offsets, then of lengths (equal unless a caller made a malformed box)
        self.ndims = _narrow(list(chain.from_iterable((len(o), len(n)) for _, o, n in items)), "B")
        self.coords = _narrow(list(chain.from_iterable(chain(o, n) for _, o, n in items)), "i")

    def __len__(self) -> int:
        return len(self.name_lens)

    def __iter__(self) -> Iterator[Piece]:
        at = pos = 0
        dims = iter(self.ndims)
        for k in self.name_lens:
            no, nl = next(dims), next(dims)
            offs = tuple(self.coords[pos : pos + no])
            lens = tuple(self.coords[pos + no : pos + no + nl])
            yield self.names[at : at + k], offs, lens
            at, pos = at + k, pos + no + nl

    def append(self, piece: Piece) -> None:
        self.__setstate__(PackedBoxes([*self, piece]).__getstate__())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackedBoxes) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"PackedBoxes({list(self)!r})"

    def __getstate__(self) -> tuple[Any, ...]:
        # type codes and bytes: a few dozen bytes of pickle for a rank with no box (pickled arrays take ~200 each)
        return self.names, *((a.typecode, a.tobytes()) for a in (self.name_lens, self.ndims, self.coords))

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.names = state[0]
        arrays = []
        for code, raw in state[1:]:
            a = array(code)
            a.frombytes(raw)
            arrays.append(a)
        self.name_lens, self.ndims, self.coords = arrays


def _narrow(values: list[int], code: str) -> array:
    """``values`` as an array of type ``code`` when they fit it (a smaller report), else of int64."""
    try:
        return array(code, values)
    except OverflowError:
        return array("q", values)


def _ints(np: Any, parts: list[array]) -> Any:
    """One int64 array of the values of ``parts`` (arrays of any integer type)."""
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.frombuffer(a, dtype=a.typecode) for a in parts]).astype(np.int64, copy=False)


def _rows(np: Any, a: Any, at: Any) -> Any:
    """Rows ``at`` of the column-major array ``a``, column by column (a row gather of it is slow)."""
    out = np.empty((at.size, a.shape[1]), dtype=a.dtype, order="F")
    for d in range(a.shape[1]):
        out[:, d] = a[:, d][at]
    return out


def packed(pieces: Iterable[Piece]) -> PackedBoxes:
    """``pieces`` as :class:`PackedBoxes` (itself when it already is)."""
    return pieces if isinstance(pieces, PackedBoxes) else PackedBoxes(pieces)


def check_box(
    rank: int,
    name: str,
    offs: tuple[int, ...],
    lens: tuple[int, ...],
    metas: dict[str, TensorDesc],
    seen: set[Any],
) -> Box:
    """A written box of tensor ``name``: described by some rank, inside its shape, not written before."""
    d = metas.get(name)
    if d is None:
        raise ManifestError(f"rank {rank} wrote tensor {name!r} that no rank described")
    shape = d.shape
    ok = len(offs) == len(shape) == len(lens)
    if ok:
        for o, n, s in zip(offs, lens, shape):  # noqa: B905 - lengths checked just above
            if o < 0 or n < 0 or o + n > s:
                ok = False
                break
    if not ok:
        raise ManifestError(
            f"rank {rank} wrote box {list(offs)}+{list(lens)} of tensor {name!r}, "
            f"which lies outside its shape {list(shape)}"
        )
    key = (name, tuple(offs), tuple(lens))
    if key in seen and 0 not in lens:
        raise ManifestError(f"tensor {name!r}: box {list(offs)}+{list(lens)} was written twice")
    seen.add(key)
    return Box(key[1], key[2])


def check_covered(name: str, shape: tuple[int, ...], stored: int) -> None:
    """The boxes written of a tensor (checked by :func:`check_box`) hold as many elements as the tensor."""
    total = math.prod(shape)
    if stored != total:
        raise ManifestError(f"tensor {name!r}: written shards hold {stored} of {total} elements")


def tile_one_by_one(
    by_name: dict[str, TensorDesc], written: Sequence[tuple[int, Iterable[Piece]]]
) -> dict[str, JSON]:
    """The per-box path: ``(rank, boxes)`` of every writer checked one box at a time (the first bad box named), then
    every tensor's coverage in ``by_name``'s order, then its ``pieces``."""
    boxes: dict[str, list[tuple[Box, int]]] = {n: [] for n in by_name}
    seen: set[Any] = set()
    for rank, pieces in written:
        for name, offs, lens in pieces:
            box = check_box(rank, name, offs, lens, by_name, seen)
            if box.numel:
                boxes[name].append((box, rank))
    out = {}
    for n, d in by_name.items():
        check_covered(n, d.shape, sum(b.numel for b, _ in boxes[n]))
        out[n] = describe_boxes(d.shape, boxes[n])
    return out


def tile(by_name: dict[str, TensorDesc], written: Sequence[tuple[int, Iterable[Piece]]]) -> dict[str, JSON]:
    """Every tensor's ``pieces`` from ``(rank, boxes)`` of every writer, after checking that the boxes tile every
    tensor exactly once: the result of :func:`tile_one_by_one`, computed with array operations."""
    import numpy as np

    out = _tile_arrays(np, by_name, [(r, packed(p)) for r, p in written])
    return tile_one_by_one(by_name, written) if out is None else out


def _tile_arrays(np: Any, by_name: dict[str, TensorDesc], written: list[tuple[int, PackedBoxes]]) -> Any:
    """:func:`tile` on arrays; None when a check fails or a box is not what it expects (the per-box path decides)."""
    names = list(by_name)
    n_t = len(names)
    shapes_py = [by_name[n].shape for n in names]
    dims = max((len(s) for s in shapes_py), default=0) or 1
    shape = np.ones((n_t, dims), dtype=np.int64)  # dims past a tensor's own: length 1 (its boxes: 0 + 1)
    for t, s in enumerate(shapes_py):
        shape[t, : len(s)] = s
    t_nd = np.array([len(s) for s in shapes_py], dtype=np.int64)
    tid = {n: t for t, n in enumerate(names)}
    # ranks that write the same tensors (FSDP: all of them) share one lookup of their names
    ids_of: dict[tuple[str, bytes], Any] = {}
    last: tuple[Any, Any] = (None, None)
    ids_l, nds, coords_l, ranks, counts = [], [], [], [], []
    for rank, p in written:
        key = (p.names, p.name_lens.tobytes())
        got = (
            last[1] if key == last[0] else ids_of.get(key)
        )  # compared before hashed: often the previous rank's
        if got is None:
            at, got = 0, []
            for k in p.name_lens:
                got.append(tid.get(p.names[at : at + k], -1))
                at += k
            got = ids_of[key] = np.array(got, dtype=np.int64)
        last = (key, got)
        ids_l.append(got)
        nds.append(p.ndims)
        coords_l.append(p.coords)
        ranks.append(rank)
        counts.append(len(got))
    ids = np.concatenate(ids_l) if ids_l else np.zeros(0, dtype=np.int64)
    if not ids.size:
        return None if n_t else {}
    nd = _ints(np, nds).reshape(-1, 2)
    n_o = nd[:, 0]
    if ids.min() < 0 or (n_o != t_nd[ids]).any() or (nd[:, 1] != n_o).any():
        return None  # an unknown tensor or a box of the wrong rank
    # the boxes grouped by tensor, in the writers' order within a tensor (the order describe_boxes sees them in)
    order = np.argsort(ids.astype(np.uint16) if n_t < 1 << 16 else ids, kind="stable")
    ids = ids[order]
    rank = np.repeat(np.array(ranks, dtype=np.int64), counts)[order]
    coords = _ints(np, [*coords_l, array("b", [0, 1])])  # the last two: a missing dim's offset and length
    first = (np.cumsum(2 * n_o) - 2 * n_o)[order]
    n_o = n_o[order]
    offs = np.empty(
        (ids.size, dims), dtype=np.int64, order="F"
    )  # column by column: a dim's values contiguous
    lens = np.empty((ids.size, dims), dtype=np.int64, order="F")
    pad = coords.size - 2
    same = bool((n_o == dims).all())
    for d in range(dims):
        at = first + d if same else np.where(n_o > d, first + d, pad)
        offs[:, d] = coords[at]
        lens[:, d] = coords[at + n_o if same else np.where(n_o > d, first + n_o + d, pad + 1)]
    full = lens[:, 0].copy()
    for d in range(1, dims):
        full *= lens[:, d]
    empty = np.flatnonzero(full <= 0)
    if empty.size:  # empty boxes hold nothing: not described, never "written twice"; but inside their tensor
        o, n = offs[empty], lens[empty]
        if ((o < 0) | (n < 0) | (o + n > shape[ids[empty]])).any():
            return None
        keep = np.flatnonzero(full > 0)
        ids, rank, full = ids[keep], rank[keep], full[keep]
        offs, lens = _rows(np, offs, keep), _rows(np, lens, keep)
    cnt = np.bincount(ids, minlength=n_t)
    base = np.cumsum(cnt) - cnt
    present = np.flatnonzero(cnt)
    b = base[present]
    if not b.size:  # every tensor is empty
        return (
            {n: {"split": [], "ranks": [-1]} for n in names} if not any(map(math.prod, shapes_py)) else None
        )
    lo_off = np.minimum.reduceat(offs, b, axis=0)
    lo_len = np.minimum.reduceat(lens, b, axis=0)
    if (
        (lo_off < 0).any()
        or (lo_len < 0).any()
        or (np.maximum.reduceat(offs + lens, b, axis=0) > shape[present]).any()
    ):
        return None  # outside its tensor
    total = np.concatenate(([0], np.cumsum(full)))
    stored = (total[base + cnt] - total[base]).tolist()
    if any(s != math.prod(sh) for s, sh in zip(stored, shapes_py, strict=True)):
        return None  # a gap or too much (a box written twice, overlapping boxes)
    described = _described(np, shape[present], present, b, cnt[present], lo_off, lo_len, offs, lens, rank)
    rest = [t for t in range(n_t) if cnt[t] and t not in described]
    rows: Iterator[tuple[list[int], list[int], int]] = iter(())
    if rest:  # shapes the arrays do not recognize: their boxes as lists, tensor by tensor
        mask = np.zeros(n_t, dtype=bool)
        mask[rest] = True
        at = np.flatnonzero(mask[ids])
        rows = zip(offs[at].tolist(), lens[at].tolist(), rank[at].tolist(), strict=True)
    out: dict[str, JSON] = {}
    for t, n in enumerate(names):
        if cnt[t] == 0:
            out[n] = {"split": [], "ranks": [-1]}
        elif t in described:
            out[n] = described[t]
        else:  # describe_boxes on this tensor's boxes, after the check that none was written twice
            k = len(shapes_py[t])
            pieces = [(Box(tuple(o[:k]), tuple(ln[:k])), r) for o, ln, r in islice(rows, int(cnt[t]))]
            if len({(b.offsets, b.lengths) for b, _ in pieces}) != len(pieces):
                return None
            out[n] = describe_boxes(shapes_py[t], pieces)
    return out


def _described(
    np: Any, shp: Any, present: Any, b: Any, c: Any, lo_off: Any, lo_len: Any, offs: Any, lens: Any, rank: Any
) -> dict[int, JSON]:
    """``pieces`` of the tensors whose non-empty boxes (grouped by tensor, in the writers' order) are one whole box,
    or the blocks of one regular split along one dim, each once: ``describe_boxes``'s first candidate for them,
    which it returns when it fits.  Per tensor with boxes (``present``): its shape, first box, box count, least
    offsets and lengths; per box (grouped by tensor): offsets, lengths, rank."""
    out: dict[int, JSON] = {}
    vary = lo_off != np.maximum.reduceat(offs, b, axis=0)
    n_vary = vary.sum(axis=1)
    full_rest = (lo_len == shp) & (np.maximum.reduceat(lens, b, axis=0) == shp)
    # one box holding the whole tensor: no split, one block
    whole = np.flatnonzero((c == 1) & (n_vary == 0) & (lo_off == 0).all(axis=1) & full_rest.all(axis=1))
    for j, r in zip(whole.tolist(), rank[b[whole]].tolist(), strict=True):
        out[int(present[j])] = {"split": [], "ranks": {"start": r, "steps": []}}
    # one varying dim d, k boxes: blocks i of split(shape[d], k), each box one block, each block once; the other
    # dims hold offset 0 and the whole length in every box (checked on the tensor's least/greatest values)
    dim = vary.argmax(axis=1)
    other = np.arange(shp.shape[1])[None, :] != dim[:, None]
    cand = (n_vary == 1) & ((lo_off == 0) | ~other).all(axis=1) & (full_rest | ~other).all(axis=1)
    if not cand.any():
        return out
    row = np.arange(shp.shape[0])
    length = shp[row, dim]
    rest = shp.sum(axis=1) - length
    # per box: its offset and length along the tensor's split dim (the others are 0 and the whole length)
    o_d, l_d = offs[:, 0].copy(), lens[:, 0] - np.repeat(rest, c)
    for d in range(1, offs.shape[1]):
        o_d += offs[:, d]
        l_d += lens[:, d]
    k = np.repeat(c, c)
    size = np.repeat(np.maximum(-(-length // c), 1), c)
    block = o_d // size
    fits = (
        np.repeat(cand, c)
        & (o_d == block * size)
        & (block < k)
        & (l_d == np.minimum(size, np.repeat(length, c) - o_d))
    )
    slot = np.repeat(b, c) + np.where(fits, block, 0)
    fits &= np.bincount(slot[fits], minlength=offs.shape[0])[slot] == 1
    good = np.flatnonzero(cand & (np.add.reduceat(fits.astype(np.int64), b) == c))
    if not good.size:
        return out
    block_rank = np.full(offs.shape[0], -1, dtype=np.int64)
    block_rank[slot[fits]] = rank[fits]
    # the rank of block j is start + j * step (describe_boxes's affine formula for one level)?
    start = block_rank[b]
    step = block_rank[np.minimum(b + 1, offs.shape[0] - 1)] - start
    pos = np.arange(offs.shape[0]) - np.repeat(b, c)
    wrong = np.add.reduceat(
        (block_rank != np.repeat(start, c) + pos * np.repeat(step, c)).astype(np.int64), b
    )
    for j in good.tolist():
        levels = [[int(dim[j]), int(c[j])]]
        if wrong[j] == 0:
            out[int(present[j])] = {
                "split": levels,
                "ranks": {"start": int(start[j]), "steps": [int(step[j])]},
            }
        else:
            lo = int(b[j])
            out[int(present[j])] = {"split": levels, "ranks": block_rank[lo : lo + int(c[j])].tolist()}
    return out


__all__ = ["PackedBoxes", "check_box", "check_covered", "packed", "tile", "tile_one_by_one"]
