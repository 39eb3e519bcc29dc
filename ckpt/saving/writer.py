"""Writing a checkpoint one tensor at a time, with bounded memory: the output side of converters.

Tensors handed to :meth:`StreamingWriter.add` are buffered until ``flush_bytes`` accumulate, then written as one
data file by a background thread while the caller prepares the next batch (reading, splitting and hashing overlap
with the disk writes).  At most one file is in flight, so memory stays bounded by twice ``flush_bytes`` plus the
tensor being added, whatever the model size.  :meth:`commit` writes the manifest (create-only) once everything is on storage; :meth:`abort` removes
what was written.  Several processes (e.g. ranks under torchrun) can each write a disjoint share of the tensors
with their own writer and let one of them commit all receipts with :func:`ckpt.format.publish.build_manifest`.
"""

from __future__ import annotations

import contextlib
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..errors import CheckpointExistsError, CkptError
from ..format.dtypes import dtype_name
from ..format.manifest import MANIFEST_NAME, Box, Layout, Manifest, TensorDesc
from ..format.publish import Receipt, build_manifest, data_file_name, publish, write_data_file
from ..storage import Storage, open_storage
from .planning import DEFAULT_CHUNK_BYTES, chunk_boxes

DEFAULT_FLUSH_BYTES = 512 << 20


class StreamingWriter:
    """One process's writer into checkpoint ``path`` (see module docstring)."""

    def __init__(
        self,
        path: str | Storage,
        *,
        rank: int = 0,
        attempt: str | None = None,
        codec: str = "raw",
        flush_bytes: int = DEFAULT_FLUSH_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        background: bool = True,
    ) -> None:
        self.storage = path if isinstance(path, Storage) else open_storage(path, storage_options)
        if rank == 0 and self.storage.exists(MANIFEST_NAME):
            if not overwrite:
                raise CheckpointExistsError(
                    f"{self.storage.display(MANIFEST_NAME)} already exists (pass overwrite)"
                )
            self.storage.delete(MANIFEST_NAME)
        self.rank = rank
        self.attempt = attempt or uuid.uuid4().hex[:8]
        self.codec = codec
        self.flush_bytes = flush_bytes
        self.chunk_bytes = chunk_bytes
        self.receipt = Receipt(rank)
        self.metas: dict[str, TensorDesc] = {}
        self._pending: list[tuple[str, Box, torch.Tensor]] = []
        self._pending_bytes = 0
        self._seq = 0
        self.bytes_written = 0
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-stream") if background else None
        )
        self._inflight: Future | None = None

    def add(
        self,
        name: str,
        tensor: torch.Tensor,
        *,
        role: str = "parameter",
        shape: tuple[int, ...] | None = None,
        box: Box | None = None,
        param: str | None = None,
        key: str | None = None,
        partition: dict[str, Any] | None = None,
    ) -> None:
        """Queue ``tensor`` as ``box`` of logical tensor ``name`` (all of it by default). Do not mutate it after."""
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        shape = tuple(shape if shape is not None else t.shape)
        box = box or Box.full(shape)
        if box.lengths != tuple(t.shape):
            raise CkptError(
                f"tensor {name!r}: data shape {list(t.shape)} does not match its box {list(box.lengths)}"
            )
        meta = TensorDesc(name, role, shape, dtype_name(t.dtype), param, key, partition)
        if self.metas.setdefault(name, meta) != meta:
            raise CkptError(f"tensor {name!r} added twice with different metadata")
        for b in chunk_boxes(box, t.element_size(), self.chunk_bytes):
            sub = t[b.relative_to(box)[0]] if b != box else t
            self._pending.append((name, b, sub))
        self._pending_bytes += t.numel() * t.element_size()
        if self._pending_bytes >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        """Write everything queued as one data file (in the background; errors surface at the next call)."""
        self._drain()
        if not self._pending:
            return
        fname = data_file_name(self.rank, self.attempt, self._seq)
        self._seq += 1
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        if self._pool is None:
            self._write(fname, batch)
        else:
            self._inflight = self._pool.submit(self._write, fname, batch)

    def _drain(self) -> None:
        fut, self._inflight = self._inflight, None
        if fut is not None:
            fut.result()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _write(self, fname: str, batch: list[tuple[str, Box, torch.Tensor]]) -> None:
        self.bytes_written += write_data_file(self.storage, self.receipt, fname, batch, self.codec)

    def finish(self) -> Receipt:
        """Flush, wait for the writes and return this writer's receipt (for a multi-process commit)."""
        self.flush()
        self._drain()
        return self.receipt

    def commit(
        self,
        *,
        step: int,
        backend: str,
        layout: Layout | None = None,
        trees: dict[str, Any] | None = None,
        receipts: list[Receipt] | None = None,
        metas: list[TensorDesc] | None = None,
        env: dict[str, Any] | None = None,
    ) -> Manifest:
        """Write the manifest (create-only). ``receipts``/``metas`` default to this writer's own."""
        own = self.finish()
        self._shutdown()
        manifest = build_manifest(
            step=step,
            backend=backend,
            layout=layout or Layout(),
            metas=metas if metas is not None else list(self.metas.values()),
            receipts=receipts if receipts is not None else [own],
            trees=trees or {},
            env=env,
        )
        publish(self.storage, manifest)
        return manifest

    def close(self) -> None:
        """Stop the background thread (after :meth:`finish`, :meth:`commit` or :meth:`abort`; idempotent)."""
        self._shutdown()

    def abort(self) -> None:
        """Delete the files this writer published (nothing was committed)."""
        self._pending = []
        with contextlib.suppress(Exception):  # aborting anyway: a failed write published nothing
            self._drain()
        self._shutdown()
        for fname, _ in self.receipt.files:
            self.storage.delete(fname)
        self.receipt.files.clear()
        self.receipt.shards.clear()
