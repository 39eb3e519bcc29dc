"""Staging for saves from XLA devices: sync the pending graph, then one batched device->host transfer.

The core :class:`~ckpt.saving.staging.HostStager` copies tensor by tensor into a pinned arena, which on XLA would be one
transfer (and one graph execution) per tensor.  Here the whole save is fetched with one runtime call after one
``sync``; the fetched host tensors are fresh buffers owned by the stager until the background write finished, so
the training loop may continue (and mutate its device tensors) as soon as :meth:`XlaStager.stage` returns.
"""

from __future__ import annotations

import time

import torch

from .transfer import is_xla, sync, to_host


class XlaStager:
    """Drop-in for ``HostStager`` (same ``stage``/``release``/``nbytes``); CPU tensors are cloned."""

    def __init__(self) -> None:
        self._held: list[torch.Tensor] = []
        self.last_transfer_s = 0.0
        self.last_sync_s = 0.0

    def stage(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``tensors`` (same shapes and dtypes) after executing the pending XLA graph."""
        t0 = time.perf_counter()
        if any(is_xla(t) for t in tensors):
            sync()
        t1 = time.perf_counter()
        self._held = to_host(tensors)
        self.last_sync_s, self.last_transfer_s = t1 - t0, time.perf_counter() - t1
        return self._held

    def release(self) -> None:
        self._held = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._held)
