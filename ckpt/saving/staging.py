"""Host staging for asynchronous saves: copying the saved tensors into host memory, now or in the background.

Tensors are copied into one reusable host arena (pinned when any tensor lives on CUDA, so device-to-host copies
run as DMA on a side stream).  :meth:`HostStager.begin` lays the tensors out in the arena and starts the copies:

* *eager* tensors are copied before ``begin`` returns (CPU), or ordered before anything the caller's stream runs
  next (CUDA: the current stream waits on the copy's event, so the host never blocks);
* *lazy* tensors are copied while training continues: a helper thread on CPU, the side stream on CUDA.  The
  caller must call :meth:`Staged.before_mutation` before it mutates one of them; the checkpointer does that from
  ``Optimizer.step`` pre-hooks (:mod:`ckpt.saving.checkpointer`).

The background writer calls :meth:`Staged.wait` before reading the arena.  The arena is reused by the next save,
which the checkpointer starts only after the previous one finished, and it grows only when the state grows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..format.datafile import aligned
from .worker import Job, Worker

# the lazy copies of every stager, one after the other, on one thread kept across saves
_STAGE = Worker("ckpt-stage")


class Staged:
    """One save's host copies (``hosts``, same shapes and dtypes as the sources) and the copies still running.

    ``before_mutation()`` is what the training thread waits on before it mutates a saved tensor: it returns as soon
    as every lazy copy has read its source (CPU: the helper thread finished; CUDA: the caller's stream is made to
    wait on the copy's event, no host block).  ``wait()`` blocks the host until the bytes are in ``hosts``.
    """

    def __init__(self, hosts: list[torch.Tensor]) -> None:
        self.hosts = hosts
        self._thread: Job | None = None
        self._event: Any = None  # torch.cuda.Event of the side-stream copies
        self._error: BaseException | None = None
        self._sources: list[torch.Tensor] = []  # kept alive until copied
        self._ordered = False  # the current stream already waits on the event
        self.copy_s = 0.0  # seconds the background copy took (CPU thread)

    # ---------------------------------------------------------------------------------------------- training side
    @property
    def pending(self) -> bool:
        """True while some source may still be read by a copy."""
        t = self._thread
        if t is not None and t.is_alive():
            return True
        return self._event is not None and not self._ordered and not self._event.query()

    def before_mutation(self) -> None:
        """Return once mutating any source can no longer change the saved bytes (see class docstring)."""
        t = self._thread
        if t is not None:
            t.join()
        ev = self._event
        if ev is not None and not self._ordered:
            torch.cuda.current_stream().wait_event(ev)
            self._ordered = True

    # ---------------------------------------------------------------------------------------------- writer side
    def wait(self) -> None:
        """Block the host until every copy landed in ``hosts``; raise the copy's error, if any."""
        t = self._thread
        if t is not None:
            t.join()
        if self._event is not None:
            self._event.synchronize()
        self._sources = []
        if self._error is not None:
            raise self._error

    # ---------------------------------------------------------------------------------------------- internals
    def _start_thread(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        copy: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None],
    ) -> None:
        self._sources.extend(s for s, _ in pairs)

        def run() -> None:
            t0 = time.perf_counter()
            try:
                copy(pairs)
            except BaseException as e:  # noqa: BLE001 - raised by wait() in the writer
                self._error = e
            self.copy_s = time.perf_counter() - t0

        self._thread = _STAGE.submit(run)


class HostStager:
    """Copies tensors to host memory (now or in the background); reuses its buffer across saves."""

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

    def _places(self, tensors: Sequence[torch.Tensor], file_offsets: Sequence[int] | None) -> list[int]:
        """Where each tensor starts in the arena: back to back, each on a :data:`BUFFER_ALIGN` boundary."""
        places, pos = [], 0
        for t in tensors:
            places.append(pos)
            pos += aligned(t.numel() * t.element_size())
        return places

    def _views(
        self, tensors: Sequence[torch.Tensor], file_offsets: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        places = self._places(tensors, file_offsets)
        end = max(
            (p + aligned(t.numel() * t.element_size()) for p, t in zip(places, tensors, strict=True)),
            default=0,
        )
        cuda = any(t.is_cuda for t in tensors)
        arena = self._arena_for(end, pinned=cuda and torch.cuda.is_available())
        views = []
        for t, pos in zip(tensors, places, strict=True):
            nbytes = t.numel() * t.element_size()
            views.append(
                arena[pos : pos + nbytes].view(t.dtype).view(t.shape)
                if nbytes
                else torch.empty(t.shape, dtype=t.dtype)
            )
        return views

    def begin(
        self,
        tensors: Sequence[torch.Tensor],
        lazy: Sequence[bool] | None = None,
        file_offsets: Sequence[int] | None = None,
    ) -> Staged:
        """Lay ``tensors`` out in the arena and start copying; ``lazy[i]`` copies tensor i in the background.

        ``file_offsets[i]``: where tensor i's bytes will start in the data file written from the arena.  A stager
        that writes with direct I/O (:class:`~ckpt.saving.process_writer.ProcessStager`) places each tensor at an
        arena address congruent to it; this one ignores it."""
        flags = list(lazy) if lazy is not None else [False] * len(tensors)
        views = self._views(tensors, file_offsets)
        staged = Staged(views)
        cpu_lazy: list[tuple[torch.Tensor, torch.Tensor]] = []
        cuda_pairs: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        for src, dst, lz in zip(tensors, views, flags, strict=True):
            s = src.detach()
            if s.is_cuda:
                cuda_pairs.append((s, dst, lz))
            elif lz:
                cpu_lazy.append((s, dst))
            else:
                dst.copy_(s)
        if cuda_pairs:
            self._copy_cuda(staged, cuda_pairs)
        if cpu_lazy:
            staged._start_thread(cpu_lazy, self.copy_background)
        return staged

    def copy_background(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The helper thread's copy of lazy CPU tensors (source, destination) in order; torch releases the GIL
        inside ``copy_``, so it runs beside the training thread."""
        for src, dst in pairs:
            dst.copy_(src)

    def stage(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``tensors`` (same shapes and dtypes), views into the reused arena, complete on return."""
        staged = self.begin(tensors)
        staged.wait()
        return staged.hosts

    def _copy_cuda(self, staged: Staged, pairs: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> None:
        """Enqueue the device-to-host copies on the side stream and record one event; never blocks the host.

        Eager copies make the current stream wait on the event at once (later kernels, including any in-place
        update, run after the copy read its source); lazy ones leave that to ``before_mutation``."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        eager = [(s, d) for s, d, lz in pairs if not lz]
        lazy = [(s, d) for s, d, lz in pairs if lz]
        with torch.cuda.stream(self._stream):
            for batch in (eager, lazy):
                for src, dst in batch:
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(self._stream)
                if batch is eager and eager:
                    done = torch.cuda.Event()
                    done.record(self._stream)
                    current.wait_event(done)
        event = torch.cuda.Event()
        event.record(self._stream)
        staged._event = event
        staged._sources.extend(s for s, _, _ in pairs)
        staged._ordered = not lazy

    def release(self) -> None:
        self._arena = None

    @property
    def nbytes(self) -> int:
        return 0 if self._arena is None else int(math.prod(self._arena.shape))
