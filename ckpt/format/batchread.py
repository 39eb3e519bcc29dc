"""Reading stored chunks straight into their destinations in batches: I/O in parallel, checksums on another thread.

A restore fills most tensors directly from the stored bytes (``CheckpointReader._direct_target``).  Done one chunk
at a time, with the checksum computed by the reading thread, the hash and the read take turns: on local disk a
checksummed load ran at 0.80x of a raw read, on object storage one ranged GET was in flight at a time.  Here a
batch of such reads goes to :meth:`~ckpt.storage.Storage.read_many` in one call (several ranged GETs in flight on
object stores) and every block is hashed on a helper thread as soon as it lands, while the next one is read.
Checksums are compared when the batch is done; the first mismatch is one line naming the file and the tensor.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

from ..errors import CorruptionError
from ..storage import Read, ReadFailed, Storage
from .codecs import StreamingChecksum
from .manifest import Shard, TensorEntry

INLINE_HASH_BYTES = 256 << 10  # reads smaller than this are hashed by the thread that read them (no hand-off)

_lock = threading.Lock()
_hasher: tuple[int, cf.ThreadPoolExecutor] | None = None


def hasher() -> cf.ThreadPoolExecutor:
    """The process's checksum thread: one worker, so the blocks of one read are hashed in the order they came
    (re-created after a fork, whose child has no threads)."""
    global _hasher
    with _lock:
        if _hasher is None or _hasher[0] != os.getpid():
            _hasher = (os.getpid(), cf.ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash"))
        return _hasher[1]


class DirectRead(NamedTuple):
    """Stored chunk ``shard`` of tensor ``entry``, to be read into ``out`` (its exact bytes, uncompressed)."""

    entry: TensorEntry
    shard: Shard
    out: memoryview


def read_direct(storage: Storage, where: str, items: Sequence[DirectRead], verify: bool) -> None:
    """Fill every ``items[i].out`` from its stored chunk; with ``verify``, check each chunk's checksum.

    ``where`` is the checkpoint as the user named it (for messages).  A missing file, a failed read or a checksum
    mismatch is a :class:`CorruptionError` naming the file and the tensor.
    """
    if not items:
        return
    digests = [StreamingChecksum() if verify and it.shard.checksum else None for it in items]
    threaded = os.cpu_count() != 1 and any(
        d is not None and len(it.out) >= INLINE_HASH_BYTES for d, it in zip(digests, items, strict=True)
    )
    pool = hasher() if threaded else None
    pending: list[cf.Future[None]] = []

    def on_block(i: int, block: memoryview) -> None:
        d = digests[i]
        if d is None:
            return
        if pool is None or len(items[i].out) < INLINE_HASH_BYTES:
            d.update(block)
        else:
            pending.append(pool.submit(d.update, block))  # list.append is atomic: callers may be any thread

    reads = [Read(it.shard.file, it.shard.offset, it.out) for it in items]
    try:
        storage.read_many(reads, on_block if verify else None)
    except ReadFailed as failed:
        it = items[failed.index]
        if isinstance(failed.error, FileNotFoundError):
            raise CorruptionError(
                f"{where}/{it.shard.file}: missing (holds tensor {it.entry.name!r})"
            ) from None
        raise CorruptionError(f"{where}/{it.shard.file}: tensor {it.entry.name!r}: {failed.error}") from None
    finally:
        cf.wait(pending)  # no hash is still reading a destination when we return
    for fut in pending:
        fut.result()
    for it, d in zip(items, digests, strict=True):
        if d is not None:
            got = d.hexdigest()
            if got != it.shard.checksum:
                raise CorruptionError(
                    f"{where}/{it.shard.file}: tensor {it.entry.name!r} shard at {list(it.shard.box.offsets)}: "
                    f"checksum mismatch (manifest {it.shard.checksum}, data {got})"
                )
