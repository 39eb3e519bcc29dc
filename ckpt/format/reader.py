"""Reading a committed checkpoint: its manifest, and any box of any tensor, lazily.

Each shard read is one ranged read of exactly its stored bytes; a rank restoring a slice reads only the shards
that overlap it.  Checksums are verified on the stored bytes unless ``verify=False``.  Uncompressed shards whose
box is exactly the requested one are read straight into the destination tensor (no intermediate copy).

torch is imported by the methods that make tensors, not here: opening a checkpoint for its manifest
(``ckpt inspect``, ``ckpt ls``) does not need it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import CkptError, CorruptionError, ManifestError, StorageError
from ..storage import Storage, open_storage
from .batchread import DirectRead, read_direct
from .codecs import checksum, decompress
from .dtypes import dtype_from_name, itemsize
from .manifest import MANIFEST_NAME, Box, Manifest, Shard, TensorEntry

if TYPE_CHECKING:
    import torch


def read_manifest(storage: Storage, full: bool = True, top: Manifest | None = None) -> Manifest:
    """Parse and validate ``manifest.json`` under ``storage``; ManifestError if absent or invalid.

    A format v2 manifest is returned with every rank's index read into it (the same object v1 gives), unless
    ``full=False``: then its tensors have no shards and ``manifest.v2`` locates them (restores, ``ckpt ls``).
    ``top``: the ``manifest.json`` a caller already parsed (``ckpt convert``'s detection), not read again."""
    if top is not None:
        return _complete(storage, top, full)
    try:
        raw = storage.read_bytes(MANIFEST_NAME)
    except FileNotFoundError:
        if storage.local and not storage.is_dir():
            raise ManifestError(f"{storage.display()}: no such checkpoint directory") from None
        raise ManifestError(
            f"{storage.display()}: not a committed checkpoint ({MANIFEST_NAME} missing)"
        ) from None
    except StorageError as e:
        raise ManifestError(str(e)) from None
    except OSError as e:  # a file given as the checkpoint (NotADirectoryError), no permission, ...
        raise ManifestError(
            f"{storage.display(MANIFEST_NAME)}: cannot read: {e.strerror or type(e).__name__}"
        ) from None
    return _complete(storage, Manifest.from_json(raw, storage.display(MANIFEST_NAME)), full)


def _complete(storage: Storage, m: Manifest, full: bool) -> Manifest:
    if m.v2 is not None and full:
        from .index import materialize

        m = materialize(storage, m, m.v2, storage.display(MANIFEST_NAME))
    return m


def overlapping(e: TensorEntry, box: Box) -> list[tuple[Shard, Box]]:
    """The stored shards of ``e`` that overlap ``box``, each with the overlap: a restoring rank's read plan for
    one tensor (``read_box_into`` reads exactly these; ``bench/bench_scale.py`` times it without reading)."""
    out = []
    for shard in e.shards:
        inter = shard.box.intersect(box)
        if inter is not None:
            out.append((shard, inter))
    return out


class CheckpointReader:
    """Lazy per-tensor access to one checkpoint, for tools and for restores."""

    def __init__(
        self,
        path: str | Storage,
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
        lazy: bool = False,
        manifest: Manifest | None = None,
    ):
        """``lazy``: for a format v2 checkpoint, read only the top manifest now and a rank's index when a box
        needs its chunks (what a restoring rank does); ``manifest.tensors[...].shards`` then stay empty.
        ``manifest``: its top manifest, already parsed by the caller (not read again)."""
        self.storage = path if isinstance(path, Storage) else open_storage(path, storage_options)
        self.manifest = read_manifest(self.storage, full=not lazy, top=manifest)
        self.verify = verify
        self._queue: list[DirectRead] | None = None  # reads deferred inside deferred()
        self.locator: Any = None
        if self.manifest.v2 is not None and lazy:
            from .index import Locator

            self.locator = Locator(
                self.storage, self.manifest, self.manifest.v2, self.storage.display(MANIFEST_NAME)
            )

    @property
    def path(self) -> str:
        return self.storage.display()

    def names(self, role: str | None = None) -> list[str]:
        return [n for n, t in self.manifest.tensors.items() if role is None or t.role == role]

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.manifest.tensors[name]
        except KeyError:
            raise CkptError(f"{self.path}: no tensor named {name!r}") from None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.manifest.tensors:
            yield name, self.read(name)

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor, on the CPU."""
        import torch

        e = self.entry(name)
        out = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
        self.read_box_into(name, Box.full(e.shape), out)
        return out

    def read_box_into(self, name: str, box: Box, out: torch.Tensor, defer: bool = False) -> None:
        """Fill ``out`` (CPU, shape ``box.lengths``) with that box of tensor ``name``.

        The chunks read straight into ``out`` are read together (several ranged GETs in flight on object
        stores, checksums on another thread).  ``defer``: inside :meth:`deferred`, only queue those reads; they
        run with everything else queued when the block ends, so ``out`` must not be used before then.
        """
        from .datafile import tensor_bytes

        e = self.entry(name)
        if tuple(out.shape) != box.lengths:
            raise CkptError(
                f"tensor {name!r}: destination shape {list(out.shape)} != box {list(box.lengths)}"
            )
        covered = 0
        direct: list[DirectRead] = []
        for shard, inter in self.overlapping(e, box):
            covered += inter.numel
            if inter.numel == 0:
                continue
            target = self._direct_target(e, shard, box, out)
            if target is not None:
                direct.append(DirectRead(e, shard, tensor_bytes(target)))
                continue
            src = self.read_shard(e, shard)
            out[inter.relative_to(box)] = src[inter.relative_to(shard.box)]
        if covered != box.numel:
            raise CorruptionError(
                f"{self.path}: tensor {name!r}: shards cover {covered} of the {box.numel} elements requested"
            )
        if defer and self._queue is not None:
            self._queue.extend(direct)
        else:
            read_direct(self.storage, self.path, direct, self.verify)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Batch the ``read_box_into(..., defer=True)`` calls made inside the block into one parallel read at its
        end (nothing is read if the block raises).  Nested blocks join the outer one."""
        if self._queue is not None:
            yield
            return
        self._queue = []
        try:
            yield
            queue, self._queue = self._queue, None
            read_direct(self.storage, self.path, queue, self.verify)
        finally:
            self._queue = None

    def overlapping(self, e: TensorEntry, box: Box) -> list[tuple[Shard, Box]]:
        """:func:`overlapping`, reading the indexes it needs first when the manifest is a lazy v2 one."""
        if self.locator is None:
            return overlapping(e, box)
        out = []
        for shard in self.locator.shards(e.name, box):
            inter = shard.box.intersect(box)
            if inter is not None:
                out.append((shard, inter))
        return out

    def rank_trees(self, rank: int) -> tuple[Any, Any]:
        """(rng, data-loader) trees saved by ``rank``, or None each."""
        if self.locator is not None:
            return self.locator.rank_trees(rank)
        m = self.manifest
        return m.rng.get(str(rank)), m.data.get(str(rank))

    @staticmethod
    def _direct_target(e: TensorEntry, shard: Shard, box: Box, out: torch.Tensor) -> torch.Tensor | None:
        """The slice of ``out`` a stored shard can be read straight into, or None.

        That is the case when the shard is uncompressed, has ``out``'s dtype, lies inside the requested box and
        spans it fully on every dim but the first: then its rows are one contiguous run of ``out``.
        """
        if (
            shard.codec != "raw"
            or out.dtype != dtype_from_name(e.dtype)
            or out.device.type != "cpu"
            or not out.is_contiguous()
            or not shard.box.lengths
        ):
            return None
        sb = shard.box
        if sb.offsets[1:] != box.offsets[1:] or sb.lengths[1:] != box.lengths[1:]:
            return None
        start = sb.offsets[0] - box.offsets[0]
        if start < 0 or start + sb.lengths[0] > box.lengths[0]:
            return None
        return out[start : start + sb.lengths[0]]

    def read_shard(self, e: TensorEntry, shard: Shard) -> torch.Tensor:
        """One stored shard as a tensor of its box's shape (checksum verified)."""
        import torch

        raw = self._fetch(e, shard)
        self._check(e, shard, raw)
        expected = math.prod(shard.box.lengths) * itemsize(e.dtype)
        if shard.codec == "zstd":
            try:
                raw = decompress(raw, expected)
            except Exception as exc:  # noqa: BLE001
                raise CorruptionError(
                    f"{self.path}/{shard.file}: tensor {e.name!r}: cannot decompress: {exc}"
                ) from None
        if expected == 0:
            return torch.empty(shard.box.lengths, dtype=dtype_from_name(e.dtype))
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return flat.view(dtype_from_name(e.dtype)).reshape(shard.box.lengths)

    def _fetch(self, e: TensorEntry, shard: Shard) -> bytes:
        try:
            return self.storage.read_range(shard.file, shard.offset, shard.nbytes)
        except FileNotFoundError:
            raise CorruptionError(f"{self.path}/{shard.file}: missing (holds tensor {e.name!r})") from None
        except StorageError as exc:
            raise CorruptionError(f"{self.path}/{shard.file}: tensor {e.name!r}: {exc}") from None

    def _check(self, e: TensorEntry, shard: Shard, data: bytes | memoryview) -> None:
        if not self.verify or not shard.checksum:
            return
        self._mismatch(e, shard, checksum(data))

    def _mismatch(self, e: TensorEntry, shard: Shard, got: str) -> None:
        if got != shard.checksum:
            raise CorruptionError(
                f"{self.path}/{shard.file}: tensor {e.name!r} shard at {list(shard.box.offsets)}: checksum "
                f"mismatch (manifest {shard.checksum}, data {got})"
            )


def open_checkpoint(
    path: str, storage_options: dict[str, Any] | None = None, verify: bool = True
) -> CheckpointReader:
    """Open a committed checkpoint for lazy reading."""
    return CheckpointReader(path, storage_options, verify)
