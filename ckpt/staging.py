"""Host staging for asynchronous saves: the only part of an async save the training loop waits for.

Tensors are copied into one reusable host arena (pinned when any tensor lives on CUDA, so device-to-host copies
run as DMA on a side stream).  After :meth:`HostStager.stage` returns, the training loop may mutate its tensors
freely: the background writer only ever reads the arena.  The arena is reused by the next save, which the
checkpointer starts only after the previous one finished, and it grows only when the state grows.
"""

from __future__ import annotations

import math

import torch

ALIGN = 64


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class HostStager:
    """Copies tensors to host memory in one batch; reuses its buffer across saves."""

    def __init__(self) -> None:
        self._arena: torch.Tensor | None = None
        self._stream = None

    def _arena_for(self, nbytes: int, pinned: bool) -> torch.Tensor:
        a = self._arena
        if a is None or a.numel() < nbytes or (pinned and not a.is_pinned()):
            self._arena = None
            a = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
            self._arena = a
        return a

    def stage(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``tensors`` (same shapes and dtypes), views into the reused arena."""
        sizes = [_aligned(t.numel() * t.element_size()) for t in tensors]
        cuda = any(t.is_cuda for t in tensors)
        arena = self._arena_for(sum(sizes), pinned=cuda and torch.cuda.is_available())
        out = []
        pos = 0
        views = []
        for t, size in zip(tensors, sizes, strict=True):
            nbytes = t.numel() * t.element_size()
            view = (
                arena[pos : pos + nbytes].view(t.dtype).view(t.shape)
                if nbytes
                else torch.empty(t.shape, dtype=t.dtype)
            )
            views.append(view)
            pos += size
        if cuda:
            self._copy_cuda(tensors, views)
        else:
            for src, dst in zip(tensors, views, strict=True):
                dst.copy_(src.detach())
        out.extend(views)
        return out

    def _copy_cuda(self, tensors: list[torch.Tensor], views: list[torch.Tensor]) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for src, dst in zip(tensors, views, strict=True):
                dst.copy_(src.detach(), non_blocking=src.is_cuda)
                if src.is_cuda:
                    src.record_stream(self._stream)
        self._stream.synchronize()

    def release(self) -> None:
        self._arena = None

    @property
    def nbytes(self) -> int:
        return 0 if self._arena is None else int(math.prod(self._arena.shape))
