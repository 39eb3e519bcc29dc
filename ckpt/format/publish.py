"""Turning what ranks wrote (receipts) into a manifest, and publishing it: the commit step shared by the
training-loop saver and the streaming writer used by converters."""

from __future__ import annotations

import datetime
import math
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError
from ..state import environment
from ..storage import Storage
from .index import DEFAULT_FORMAT_VERSION
from .manifest import MANIFEST_NAME, Box, FileEntry, Layout, Manifest, Shard, TensorDesc, TensorEntry


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

    keys = [f"{name}@{','.join(map(str, box.offsets))}" for name, box, _ in chunks]
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
    return manifest_of(
        step=step,
        backend=backend,
        layout=layout,
        tensors=tensors,
        files=files,
        trees=trees,
        rng={str(r): t["rng"] for r, t in sorted(rank_trees.items()) if "rng" in t} or trees.get("rng", {}),
        data={str(r): t["data"] for r, t in sorted(rank_trees.items()) if "data" in t}
        or trees.get("data", {}),
        env=env,
    )


def manifest_of(
    *,
    step: int,
    backend: str,
    layout: Layout,
    tensors: dict[str, TensorEntry],
    files: dict[str, FileEntry],
    trees: dict[str, Any],
    rng: dict[str, Any],
    data: dict[str, Any],
    env: dict[str, Any] | None,
) -> Manifest:
    """The in-memory manifest of a commit (its time stamp and environment taken now unless ``env`` is given)."""
    return Manifest(
        step=step,
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        backend=backend,
        layout=layout,
        tensors=tensors,
        files=files,
        optimizer=trees.get("optimizer"),
        scheduler=trees.get("scheduler"),
        scaler=trees.get("scaler"),
        rng=rng,
        progress=trees.get("progress", {"step": step}),
        data=data,
        tokenizer=trees.get("tokenizer"),
        environment=env if env is not None else environment.capture(layout.world_size),
        user=trees.get("user"),
        extra=trees.get("extra", {}),
        data_position=trees.get("data_position"),
        rng_base=trees.get("rng_base"),
        adapter=trees.get("adapter"),
    )


def publish(storage: Storage, manifest: Manifest, version: int | None = None) -> None:
    """Write the manifest create-only: the commit point.  Format v2 writes each rank's index first (create-only,
    named after the save attempt of the rank's data files), then the top manifest that seals their checksums."""
    version = DEFAULT_FORMAT_VERSION if version is None else version
    if version == 1:
        storage.put_bytes(MANIFEST_NAME, manifest.to_json().encode(), exclusive=True)
        return
    from .index import encode

    attempts = {p.split("-")[1].split(".")[0] for p in manifest.files if p.startswith("r") and "-" in p}
    attempt = sorted(attempts)[0] if len(attempts) == 1 else uuid.uuid4().hex[:8]
    top, indexes = encode(manifest, attempt)
    for path, text in indexes.items():
        storage.put_bytes(path, text.encode(), exclusive=True)
    storage.put_bytes(MANIFEST_NAME, top.encode(), exclusive=True)
