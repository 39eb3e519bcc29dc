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

Where each tensor's pieces are, and the tables of these files, are :mod:`ckpt.format.placement`'s.  Writing: the
training-loop saver has each rank write its own index and state file (:func:`ckpt.format.publish.write_rank_files`);
writers holding every shard in one process encode an in-memory manifest (:func:`encode`).  Either way both versions
hold exactly the same facts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from ..errors import ManifestError
from .codecs import CODECS, check_checksum_format, check_codec
from .dtypes import itemsize
from .manifest import Manifest, manifest_doc
from .placement import IndexEntry, Placement, box_in, describe_pieces
from .schema import (
    JSON,
    SEAL_RE,
    Box,
    FileEntry,
    Shard,
    TensorDesc,
    TensorEntry,
    check_relpath,
    seal,
    verify_seal,
)

INDEX_FORMAT = "ckpt-index"
STATE_FORMAT = "ckpt-rank-state"


def index_name(rank: int, attempt: str) -> str:
    """The index file of ``rank`` for save attempt ``attempt`` (next to its data files)."""
    return f"r{rank:05d}-{attempt}.index.json"


# ------------------------------------------------------------------------------------------------ writing


def state_name(rank: int, attempt: str) -> str:
    """The per-rank state file of ``rank`` (its RNG and data-loader trees) for save attempt ``attempt``."""
    return f"r{rank:05d}-{attempt}.state.json"


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
    training-loop saver has each rank write its own files instead (:func:`ckpt.format.publish.write_rank_files`)."""
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
    box = box_in(offs, lens, t.shape, cw)
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

    def __init__(self, storage: Any, manifest: Manifest, layout: Placement, source: str) -> None:
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


def materialize(storage: Any, m: Manifest, layout: Placement, source: str) -> Manifest:
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
    "INDEX_FORMAT",
    "STATE_FORMAT",
    "Locator",
    "chunk_row",
    "encode",
    "index_name",
    "index_text",
    "load_index",
    "load_state",
    "materialize",
    "sealed_entry",
    "state_holds",
    "state_name",
    "state_text",
    "top_text",
]
