"""Our own format (docs/format.md) as a conversion source and target.

Source (:class:`ManifestSource`): a committed checkpoint, CUDA layout (full tensors) or Neuron layout
(``layout.kind == "nxd"``: TP rank ``r``'s part of a partitioned tensor is box ``r``; ``extra.nxd`` says the rest).
A piece is read as a box straight from the data files (only the chunks it overlaps), except slices across a
tensor's columns (a dim-1 split such as ``o_proj``), which would read every row of the tensor once per TP rank:
those tensors are read whole once into a small cache and sliced.

Target (:class:`ManifestExport`): units are target tensors (byte-balanced over workers); every worker streams its
share into data files named with the attempt id (:class:`ckpt.saving.writer.StreamingWriter`), and the coordinator's
``manifest.json`` is the commit.  Aborting removes the attempt's data files.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ckpt.errors import CheckpointExistsError, CkptError, LayoutError
from ckpt.format.dtypes import dtype_from_name
from ckpt.format.manifest import MANIFEST_NAME, Box, Manifest
from ckpt.format.publish import Receipt, build_manifest, publish
from ckpt.format.reader import CheckpointReader
from ckpt.layouts import Piece
from ckpt.layouts.record import NxdRecord
from ckpt.saving.writer import StreamingWriter
from ckpt.storage import Storage, open_storage

from .engine import Conversion, OutPart, Source, Staging, Trees, UnitReceipt, check_cover, write_share
from .engine.export import Progress

NAME = "ckpt"
#: chunks cut by a row slice kept for the next slices (the next TP rank's rows; a fused target tensor such as
#: ``gate_up_proj`` or ``qkv_proj`` alternates between the chunks of 2 or 3 source tensors)
CUT_CHUNKS = 3
CUDA_KINDS = ("replicated", "dtensor", "fsdp", "ddp", "cuda", "full")


def manifest_layout(m: Manifest) -> str | None:
    """``"neuron"`` for a Neuron-layout manifest (TP boxes, NxD's fused and head-ordered tensors), ``"cuda"`` for
    full tensors under their state_dict names, None for a layout neither reader knows."""
    if m.layout.kind == "nxd" or (m.backend == "neuron" and isinstance(m.extra.get("nxd"), dict)):
        return "neuron"
    if m.layout.kind in CUDA_KINDS or m.layout.tp == 1:
        return "cuda"
    return None


def detect(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    return open_storage(path, dict(storage_options) if storage_options else None).exists(MANIFEST_NAME)


def is_adapter(path: str, storage_options: Mapping[str, Any] | None = None) -> Manifest | None:
    """The format table's adapter probe: the top manifest of a checkpoint of ours at ``path`` (its ``adapter`` says
    whether it is adapter-only), read once and handed down; None for anything else, or an unreadable one (the
    reader then says why)."""
    try:
        storage = open_storage(path, dict(storage_options) if storage_options else None)
        if not storage.exists(MANIFEST_NAME):
            return None
        return Manifest.from_json(storage.read_bytes(MANIFEST_NAME), storage.display(MANIFEST_NAME))
    except CkptError:
        return None


class ManifestSource(Source):
    """A committed checkpoint in our format (Neuron layout iff ``layout.kind == "nxd"``)."""

    format = NAME

    def __init__(
        self,
        path: str | Storage,
        *,
        config: Mapping[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
        cache_tensors: int = 2,
        manifest: Manifest | None = None,
    ) -> None:
        self.reader = CheckpointReader(path, storage_options, verify, manifest=manifest)
        m = self.reader.manifest
        self.path = self.reader.path
        self.trees = Trees.of_manifest(m)
        self.tensors = {n: e.desc for n, e in m.tensors.items()}
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_size = cache_tensors
        self._chunks: OrderedDict[tuple[str, str, int], torch.Tensor] = OrderedDict()
        nxd = m.extra.get("nxd")
        kind = manifest_layout(m)
        if kind == "neuron":
            if nxd is None:
                raise LayoutError(f"{self.path}: Neuron-layout checkpoint without extra.nxd; unknown layout")
            self.layout = "neuron"
            self.record = NxdRecord.from_extra(nxd, self.path)
            flags = self.record.flags(tp=m.layout.tp, pp=m.layout.pp, dp=m.layout.dp)
            self.flags = dataclasses.replace(
                flags, ep=m.layout.ep or 1
            )  # EP lives in the layout, not extra.nxd
            self.zero1 = m.layout.zero_stage == 1
            self.config = dict(config) if config is not None else self.record.config
        elif kind == "cuda":
            self.layout = "cuda"
            cfg = config if config is not None else m.extra.get("config")
            self.config = dict(cfg) if cfg else None
        else:
            raise LayoutError(
                f"{self.path}: unknown layout kind {m.layout.kind!r} with tp={m.layout.tp}; cannot convert it"
            )

    def pp_ranks(self, name: str) -> tuple[int, ...]:
        saved = self.record.pp_ranks if self.record is not None else None
        if saved is not None and self.flags is not None and self.flags.pp > 1:
            if name not in saved:
                raise LayoutError(f"{self.path}: extra.nxd.pp_ranks has no PP rank for {name!r}")
            return tuple(saved[name])
        return super().pp_ranks(name)

    def _box(self, piece: Piece) -> Box:
        """The box of the logical tensor that ``piece`` (rank-local coordinates for a Neuron layout) reads."""
        desc = self.tensors[piece.name]
        shape = desc.shape
        offsets = [0] * len(shape)
        lengths = list(shape)
        if piece.rank is not None and desc.partition is not None:
            d = int(desc.partition["dim"])
            local = self.local_shape(desc)
            offsets[d] = piece.rank[0] * local[d]
            lengths[d] = local[d]
        if piece.dim is not None:
            offsets[piece.dim] += piece.start
            lengths[piece.dim] = piece.length
        return Box(tuple(offsets), tuple(lengths))

    def locate(self, piece: Piece) -> Hashable:
        return (piece.name, self._box(piece))

    @property
    def storage(self) -> Storage:
        """Where the data files are read from (what a rank's read count is taken at: engine/meter.py)."""
        return self.reader.storage

    def extents(self, piece: Piece) -> list[tuple[Hashable, int, int]]:
        """The stored chunks reading ``piece`` fetches, each whole: ``(file, offset, end)``."""
        e = self.reader.entry(piece.name)
        return [
            (s.file, s.offset, s.offset + s.nbytes) for s, _ in self.reader.overlapping(e, self._box(piece))
        ]

    def read(self, piece: Piece) -> torch.Tensor:
        desc = self.tensors[piece.name]
        box = self._box(piece)
        full = Box.full(desc.shape)
        if piece.name in self._cache:
            return self._whole(piece.name)[box.relative_to(full)]
        if box == full:
            return self.reader.read(piece.name)
        e = self.reader.entry(piece.name)
        cover = self.reader.overlapping(e, box)
        if self._column_slice(piece) and len(cover) == len(e.shards):
            # a slice across the columns of row chunks: every chunk holds some of it, and the next TP rank's
            # slice needs them all again; read the tensor once and keep it
            return self._whole(piece.name)[box.relative_to(full)]
        out = torch.empty(box.lengths, dtype=dtype_from_name(desc.dtype))
        with self.reader.deferred():  # the chunks inside the box: read straight into it, several at once
            for shard, inter in cover:
                where = inter.relative_to(box)
                if inter == shard.box:
                    self.reader.read_box_into(piece.name, inter, out[where], defer=True)
                else:  # a chunk the box cuts: the next slice (another TP rank's) reads its other part
                    out[where] = self._chunk(e, shard)[inter.relative_to(shard.box)]
        return out

    def _chunk(self, e: Any, shard: Any) -> torch.Tensor:
        """A stored chunk, kept while the next slices of it are read (each chunk fetched once per pass)."""
        key = (e.name, shard.file, shard.offset)
        t = self._chunks.get(key)
        if t is None:
            t = self._chunks[key] = self.reader.read_shard(e, shard)
            while len(self._chunks) > CUT_CHUNKS:
                self._chunks.popitem(last=False)
        else:
            self._chunks.move_to_end(key)
        return t

    def _whole(self, name: str) -> torch.Tensor:
        t = self._cache.get(name)
        if t is None:
            t = self._cache[name] = self.reader.read(name)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(name)
        return t

    def _column_slice(self, piece: Piece) -> bool:
        desc = self.tensors[piece.name]
        box = self._box(piece)
        return box != Box.full(desc.shape) and any(
            o or n != s for o, n, s in zip(box.offsets[1:], box.lengths[1:], desc.shape[1:], strict=True)
        )

    def read_anon(self, piece: Piece) -> int:
        """A fresh tensor of the piece; a column slice reads (and caches) its whole tensor."""
        return self.stored_bytes(piece) if self._column_slice(piece) else self.piece_bytes(piece)

    def cache_bytes(self, pieces: Iterable[Piece]) -> int:
        """The whole tensors kept for column slices, and the chunks kept for row slices that cut them."""
        sliced, cut = [], []
        for p in pieces:
            if self._column_slice(p):
                sliced.append(self.stored_bytes(p))
            elif self._box(p) != Box.full(self.tensors[p.name].shape):
                cut.extend(s.nbytes for s in self.reader.entry(p.name).shards)
        return self._cache_size * max(sliced, default=0) + CUT_CHUNKS * max(cut, default=0)

    def close(self) -> None:
        self._cache.clear()
        self._chunks.clear()


def open_source(path: str, *, config: Mapping[str, Any] | None, storage_options: dict[str, Any] | None,
                verify: bool = True, manifest: Manifest | None = None, **_: Any) -> ManifestSource:  # fmt: skip
    return ManifestSource(path, config=config, storage_options=storage_options, verify=verify, manifest=manifest)


class ManifestExport:
    """Our format as an :class:`~converters.engine.Export`: units = target tensors, the manifest = the commit."""

    def __init__(
        self,
        conv: Conversion,
        *,
        flush_bytes: int,
        codec: str = "raw",
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
    ) -> None:
        self.conv = conv
        self.flush_bytes = flush_bytes
        self.codec = codec
        self.storage_options = storage_options
        self.verify = verify
        self.weights = [t.desc.nbytes for t in conv.tensors]

    def begin(self, dst: str) -> Staging:
        storage = open_storage(dst, self.storage_options)
        if storage.exists(MANIFEST_NAME):
            raise CheckpointExistsError(f"{storage.display(MANIFEST_NAME)} already exists; choose a new DST")
        return Staging(dst, uuid.uuid4().hex[:8])

    def write(
        self, staging: Staging, units: Sequence[int], progress: Progress = None, *, worker: int = 0
    ) -> UnitReceipt:
        writer = StreamingWriter(
            staging.url,
            rank=worker,
            attempt=staging.attempt,
            codec=self.codec,
            flush_bytes=self.flush_bytes,
            storage_options=self.storage_options,
        )
        try:
            write_share(self.conv, writer, units, progress, verify=self.verify)
            return UnitReceipt(worker, tuple(units), writer.finish())
        except BaseException:
            writer.abort()
            raise
        finally:
            writer.close()

    def unit_parts(self, unit: int) -> Sequence[OutPart]:
        """The parts unit ``unit`` (one target tensor) is made of (what torchrun ranks plan their reads by)."""
        return self.conv.tensors[unit].parts

    def held_bytes(self, retained: Callable[[OutPart], int]) -> int:
        """The streaming writer's batches: one being filled and one being written, ``flush_bytes`` each (plus the
        part that tips one over), of the parts that stay allocated (views of mapped files cost nothing)."""
        kept = [retained(p) for t in self.conv.tensors for p in t.parts]
        return min(sum(kept), 2 * (self.flush_bytes + max(kept, default=0)))

    def commit(self, staging: Staging, dst: str, receipts: list[UnitReceipt]) -> str:
        receipts = check_cover(receipts, len(self.conv.tensors), dst)
        rs: list[Receipt] = [r.data for r in receipts]
        backend, layout = self.conv.layout()
        manifest = build_manifest(
            step=self.conv.trees.step,
            backend=backend,
            layout=layout,
            metas=[t.desc for t in self.conv.tensors],
            receipts=rs,
            trees=self.conv.trees.as_commit_trees(),
            env=self.conv.trees.environment or None,
        )
        publish(open_storage(dst, self.storage_options), manifest)
        return dst

    def abort(self, staging: Staging) -> None:
        """Remove the data files of this attempt (their names carry the attempt id)."""
        storage = open_storage(staging.url, self.storage_options)
        try:
            names = storage.listdir()
        except Exception:  # noqa: BLE001 - best effort: nothing was committed anyway
            return
        for name in names:
            if f"-{staging.attempt}-" in name:
                storage.delete(name)


def export(conv: Conversion, *, flush_bytes: int, codec: str = "raw", storage_options: dict[str, Any] | None = None,
           verify: bool = True, **_: Any) -> ManifestExport:  # fmt: skip
    return ManifestExport(
        conv, flush_bytes=flush_bytes, codec=codec, storage_options=storage_options, verify=verify
    )


__all__ = ["ManifestExport", "ManifestSource", "detect", "export", "open_source"]
