"""Host-to-device uploads for restores onto CUDA: read into a pinned buffer, copy in batches without blocking.

A per-tensor ``cpu_tensor.to("cuda")`` from pageable memory goes through a driver bounce buffer and blocks the
host for every tensor.  Here the reader fills views of one reusable pinned buffer and each view is copied with
``non_blocking=True`` on the current stream; the host waits (on an event, never a device-wide synchronize) only
when the buffer must be reused, and once at :meth:`PinnedUploader.finish`.  Tensors larger than the buffer are
uploaded in one piece through their own pinned buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..format.datafile import aligned

DEFAULT_BUFFER_BYTES = 256 * 2**20


class PinnedUploader:
    """Fills device tensors from host reads through a pinned buffer with batched non-blocking copies."""

    def __init__(self, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        self.buffer_bytes = buffer_bytes
        self._buf: torch.Tensor | None = None
        self._pos = 0
        self._event: torch.cuda.Event | None = None  # copies out of the buffer since it was last reused
        self._held: list[torch.Tensor] = []  # oversized one-off pinned buffers in flight
        self.copies = 0

    def fill(self, dst: torch.Tensor, read: Callable[[torch.Tensor], None]) -> None:
        """``read(host)`` fills a pinned host tensor shaped like ``dst``; its bytes are then copied into ``dst``
        (a CUDA tensor, contiguous or not) asynchronously on the current stream."""
        nbytes = dst.numel() * dst.element_size()
        if nbytes > self.buffer_bytes:
            host = torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True)
            read(host)
            with torch.no_grad():
                dst.copy_(host, non_blocking=True)
            self._held.append(host)
            self._record()
            self.copies += 1
            return
        size = aligned(nbytes)
        if self._buf is None:
            self._buf = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=True)
        if self._pos + size > self.buffer_bytes:
            self._drain()
        host = self._buf[self._pos : self._pos + nbytes].view(dst.dtype).view(dst.shape)
        self._pos += size
        read(host)
        with torch.no_grad():
            dst.copy_(host, non_blocking=True)
        self._record()
        self.copies += 1

    def _record(self) -> None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        self._event = ev

    def _drain(self) -> None:
        """Wait until every copy out of the pinned memory finished, so it can be reused or freed."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self._pos = 0
        self._held = []

    def finish(self) -> None:
        """Wait for the last copies and free the pinned memory."""
        self._drain()
        self._buf = None
