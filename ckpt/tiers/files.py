"""A step's files as its manifest lists them, and checking one file's bytes against that manifest.

A local step uses the checkpoint format unchanged (docs/format.md), so every file it holds can be checked without
any record of its own: a data file by its size and the checksum of every chunk (listed in its rank's sealed index,
or in a version 1 manifest), an index or state file by its seal, which the top manifest records.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import CkptError, ManifestError
from ..format.codecs import checksum
from ..format.index import INDEX_FORMAT, STATE_FORMAT, index_shards, load_index, load_sealed
from ..format.manifest import MANIFEST_NAME, Manifest, Shard
from ..storage import Storage
from ..storage.local import LocalStorage


@contextlib.contextmanager
def _mapped(storage: Storage, name: str, size: int) -> Iterator[memoryview | None]:
    """A local file mapped read-only (hashed where it lies: the memory tier's files are in /dev/shm), or None for
    other storage (read by ranges)."""
    if type(storage) is not LocalStorage or not size:
        yield None
        return
    with open(storage.path(name), "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        view = memoryview(mm)
        try:
            yield view
        finally:
            view.release()


def sealed_entries(m: Manifest) -> dict[str, Any]:
    """Index and state files of a version 2 manifest, by name ({} for version 1)."""
    return {e.path: e for e in m.v2.sealed_files()} if m.v2 is not None else {}


def rank_files(m: Manifest, rank: int) -> list[str]:
    """The files ``rank`` wrote, index and state file first (a data file is checked against its rank's index)."""
    sealed = sorted(p for p, e in sealed_entries(m).items() if e.rank == rank)
    return sealed + sorted(p for p, f in m.files.items() if f.rank == rank)


def writer_ranks(m: Manifest) -> list[int]:
    return sorted({f.rank for f in m.files.values()} | {e.rank for e in sealed_entries(m).values()})


def all_files(m: Manifest) -> list[str]:
    """Every file of the step but the manifest, each rank's in :func:`rank_files` order."""
    return [p for r in writer_ranks(m) for p in rank_files(m, r)]


def file_size(m: Manifest, name: str) -> int:
    sealed = sealed_entries(m)
    return sealed[name].size if name in sealed else m.files[name].size


@dataclass
class FileChecker:
    """Checks the files of one step held in ``storage`` against its manifest ``m`` (indexes read once each)."""

    storage: Storage
    m: Manifest
    _chunks: dict[int, dict[str, list[Shard]]] = field(default_factory=dict)

    def check(self, name: str) -> str | None:
        """None when ``name`` holds exactly the bytes the manifest describes, else one line saying why not."""
        where = self.storage.display(name)
        sealed = sealed_entries(self.m)
        try:
            if name in sealed:
                e = sealed[name]
                is_index = self.m.v2.indexes.get(e.rank) is e
                fmt, what = (INDEX_FORMAT, "index") if is_index else (STATE_FORMAT, "state file")
                load_sealed(self.storage, e, MANIFEST_NAME, fmt, what)
                return None
            f = self.m.files.get(name)
            if f is None:
                return f"{where}: not listed in {MANIFEST_NAME}"
            size = self.storage.size(name)
            if size is None:
                return f"{where}: missing"
            if size != f.size:
                return f"{where}: {size} bytes, {MANIFEST_NAME} says {f.size}"
            with _mapped(self.storage, name, size) as view:
                for tensor, shard in self._shards_in(name, f.rank):
                    end = shard.offset + shard.nbytes
                    data = view[shard.offset : end] if view is not None and end <= size else None
                    got = checksum(
                        data
                        if data is not None
                        else self.storage.read_range(name, shard.offset, shard.nbytes)
                    )
                    del data
                    if got != shard.checksum:
                        return f"{where}: tensor {tensor!r} checksum mismatch ({MANIFEST_NAME} {shard.checksum}, data {got})"
        except (CkptError, OSError) as exc:
            return str(exc) if where in str(exc) else f"{where}: {exc}"
        return None

    def _shards_in(self, name: str, rank: int) -> list[tuple[str, Shard]]:
        if self.m.v2 is None:
            return [(t, s) for t, e in self.m.tensors.items() for s in e.shards if s.file == name]
        if rank not in self._chunks:
            e = self.m.v2.indexes.get(rank)
            if e is None:
                raise ManifestError(f"{MANIFEST_NAME}: data file {name} of rank {rank}, which has no index")
            doc = load_index(self.storage, e, MANIFEST_NAME)
            self._chunks[rank] = index_shards(doc, self.m.tensors, self.m.files, self.storage.display(e.path))
        return [(t, s) for t, shards in self._chunks[rank].items() for s in shards if s.file == name]


def check_files(storage: Storage, m: Manifest, names: list[str]) -> list[str]:
    """The problems of ``names`` in ``storage`` against ``m`` (:class:`FileChecker`; indexes read once)."""
    checker = FileChecker(storage, m)
    return [e for e in map(checker.check, names) if e is not None]
