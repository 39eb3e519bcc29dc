"""A background thread kept across saves: handing it a job costs the training thread a queue put.

Starting a ``threading.Thread`` per save makes the caller wait until the new thread runs (``start()`` waits for it
to signal): one scheduler round trip per thread, milliseconds on a loaded host, paid by the training step at every
save (a save every step starts three: staging, writing, the tiers' half).  A :class:`Worker` runs its jobs in order
on one daemon thread that exits after ``idle_s`` without work and is started again by the next job, so idle
checkpointers hold no thread.  Jobs that wait on each other must use different workers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class Job:
    """A submitted job: ``is_alive()`` until it has run, ``join()`` to wait for it (a ``Thread``'s interface)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)


class Worker:
    """One thread named ``name`` running submitted callables in order (module docstring)."""

    def __init__(self, name: str, idle_s: float = 5.0) -> None:
        self.name = name
        self.idle_s = idle_s
        self._q: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Job]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._busy = 0  # jobs queued or running

    def submit(self, fn: Callable[..., Any], *args: Any) -> Job:
        """Run ``fn(*args)`` on the worker's thread; its exceptions are the job's to report (they end nowhere)."""
        job = Job()
        with self._lock:
            self._busy += 1
            self._q.put((fn, args, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        return job

    def _run(self) -> None:
        while True:
            try:
                fn, args, job = self._q.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._busy == 0:  # nothing queued since: exit; the next submit starts a thread
                        self._thread = None
                        return
                continue
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001, S110 - jobs report through their own futures
                pass
            finally:
                with self._lock:
                    self._busy -= 1
                job._done.set()
