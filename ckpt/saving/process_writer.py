"""Staging into shared memory and writing from a persistent writer process: a save's bytes never pass through
the trainer's interpreter after the copy.

:class:`ProcessStager` is a :class:`~ckpt.saving.staging.HostStager` whose arena is a ``memfd`` mapping shared
with one long-lived child (:mod:`ckpt.saving.writer_child`).  A save costs the training process one copy of each
byte into the arena (``copy_`` releases the GIL; lazily, beside the next forward/backward, as before) and one
JSON line to the child; the child hashes and writes the bytes straight from the arena (the kernel's copy into the
page cache is the only other copy) in its own process, so neither its CPU-bound Python nor its GIL ever competes
with the training thread's.  The commit (index, state file, manifest, collectives) stays in the trainer.

It is the default stager of an asynchronous save where the platform has ``memfd_create`` (Linux;
:func:`default_stager`); ``stager=HostStager()`` keeps the write in a thread of the training process.  The
checkpointer hands :meth:`ProcessStager.write_from_arena` to :func:`ckpt.format.publish.write_data_file`.  Saves it cannot serve from the arena fall
back to the in-process writer: non-local storage, compressed chunks.  For CUDA state the shared arena is
page-locked in place (``cudaHostRegister``), so device-to-host copies still run as DMA; where CUDA refuses that,
a plain pinned arena and the in-process writer serve.
Crash semantics are the in-process writer's: the trainer commits only after the child answered, a child that dies
fails the save (restarted for the next one), and the child exits when the trainer does (its lifeline pipe).
"""

from __future__ import annotations

import json
import mmap
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import StorageError
from ..format.datafile import Chunk, aligned, raw_entry
from ..format.directwrite import ALIGN
from ..format.manifest import Box
from ..storage import Storage
from ..storage.local import LocalStorage
from .staging import HostStager

# the write ends of every live writer's lifeline: a process forked from the trainer (a fork-started DataLoader
# worker) closes its inherited copies, so that only the trainer itself keeps its writer alive
_LIFELINES: set[int] = set()


def _close_lifelines_in_child() -> None:
    for fd in _LIFELINES:
        try:
            os.close(fd)
        except OSError:
            pass
    _LIFELINES.clear()


os.register_at_fork(after_in_child=_close_lifelines_in_child)


class _Writer:
    """One running child and the pipes to it; it reads the arena behind ``arena_fd``."""

    def __init__(self, arena_fd: int) -> None:
        r, self.lifeline = os.pipe()
        _LIFELINES.add(self.lifeline)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ckpt.saving.writer_child", str(arena_fd), str(r)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(arena_fd, r),
            )
        except BaseException:
            _LIFELINES.discard(self.lifeline)
            os.close(self.lifeline)
            raise
        finally:
            os.close(r)

    def request(self, req: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Hand ``req`` over and wait for the answer; a child that gives none within ``timeout_s`` (hung,
        stopped) is killed and the write fails naming it."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
            line = self._answer(timeout_s)
        except (BrokenPipeError, OSError):
            line = b""
        if line is None:
            self.proc.kill()
            self.stop()
            raise StorageError(
                f"writer process {self.proc.pid} gave no answer within {timeout_s:.0f} s while writing "
                f"{req['fname']} (killed; the data file was not published; ProcessStager(writer_timeout_s=...) "
                "sets the limit)"
            )
        if not line:
            self.stop()
            raise StorageError(
                f"writer process {self.proc.pid} exited (code {self.proc.returncode}) while writing "
                f"{req['fname']}: the data file was not published"
            )
        return json.loads(line)

    def _answer(self, timeout_s: float) -> bytes | None:
        """One line from the child (b"" at its exit), or None when none came within ``timeout_s``."""
        assert self.proc.stdout is not None
        fd, buf = self.proc.stdout.fileno(), b""
        deadline = time.monotonic() + timeout_s
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            part = os.read(fd, 1 << 16)
            if not part:
                return b""
            buf += part
        return buf

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Close the child's input (it exits between jobs) and its lifeline; kill it if it lingers."""
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        if self.lifeline >= 0:
            _LIFELINES.discard(self.lifeline)
            os.close(self.lifeline)
            self.lifeline = -1
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ProcessStager(HostStager):
    """A host stager whose arena the writer process reads; :meth:`write_data_file` hands a data file to it."""

    def __init__(self, direct_io: bool = True, writer_timeout_s: float = 120.0) -> None:
        super().__init__()
        self.direct_io = direct_io
        #: a data file's write fails when the writer has not answered within this many seconds, plus one per
        #: 50 MB of the file (a hung or stopped writer never blocks a save for ever)
        self.writer_timeout_s = writer_timeout_s  # False: the writer writes through the page cache (benches, comparisons)
        # bytes the writer sent to disk straight from the arena, through its bounce buffer, or buffered
        self.io = {"direct": 0, "bounced": 0, "buffered": 0}
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._writer: _Writer | None = None
        self._pinned = False  # the shared arena is page-locked for CUDA copies (cudaHostRegister)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_all, [])

    # -------------------------------------------------------------------------------------------- the arena
    def _arena_for(self, nbytes: int, pinned: bool) -> torch.Tensor:
        a = self._arena
        if a is not None and self._map is not None and a.numel() >= nbytes and (self._pinned or not pinned):
            return a
        self._arena = None
        self._drop_shared()
        size = max(nbytes, 1)
        self._fd = os.memfd_create("ckpt-arena", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        arena = torch.frombuffer(self._map, dtype=torch.uint8)
        if pinned and not _pin(
            arena
        ):  # CUDA state, and the shared pages cannot be page-locked: a pinned arena
            del arena  # (written by the in-process writer)
            self._drop_shared()
            return super()._arena_for(nbytes, pinned)
        self._pinned = pinned
        self._arena = arena
        return arena  # the writer starts at the first file it writes (~50 ms: it imports no torch)

    def _places(self, tensors: Sequence[torch.Tensor], file_offsets: Sequence[int] | None) -> list[int]:
        """Each tensor at the first arena address at or after the previous one's end that is congruent to its
        file offset modulo :data:`~ckpt.format.directwrite.ALIGN`, so that the writer sends its whole blocks to
        the disk straight from the arena (direct I/O).  Payloads lie back to back in the file, so after a congruent
        tensor the next one needs no gap.  A tensor whose congruent address would not suit its dtype (an odd-sized
        bf16 chunk before an fp32 one) goes on a :data:`~ckpt.format.datafile.BUFFER_ALIGN` boundary instead and is written through the
        bounce buffer."""
        if file_offsets is None:
            return super()._places(tensors, file_offsets)
        places, pos = [], 0
        for t, off in zip(tensors, file_offsets, strict=True):
            p = pos + (off - pos) % ALIGN
            if p % t.element_size():
                p = aligned(pos)
            places.append(p)
            pos = p + t.numel() * t.element_size()
        return places

    def _start_writer(self) -> _Writer:
        with self._lock:
            if self._writer is None or not self._writer.alive:
                if self._writer is not None:
                    self._writer.stop()
                self._writer = _Writer(self._fd)
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _close_all, [self._writer])
            return self._writer

    def _drop_shared(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.stop()
                self._writer = None
        if self._pinned and self._arena is not None:
            torch.cuda.cudart().cudaHostUnregister(self._arena.data_ptr())
        self._pinned = False
        self._arena = None
        self._map = None  # unmapped once the last view of the arena is gone
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def release(self) -> None:
        self._drop_shared()
        super().release()

    @property
    def writer_pid(self) -> int | None:
        """The writer process's id while one runs (tests, benches: its CPU time, crash tests)."""
        w = self._writer
        return w.proc.pid if w is not None and w.alive else None

    # -------------------------------------------------------------------------------------------- writing
    def _spans(self, chunks: Sequence[tuple[str, Box, Any]]) -> list[tuple[int, int]] | None:
        """Where each chunk's bytes lie in the shared arena, or None when any does not lie there."""
        a = self._arena
        if a is None or self._map is None:
            return None
        base, end = a.data_ptr(), a.data_ptr() + a.numel()
        spans = []
        for _, _, t in chunks:
            n = t.numel() * t.element_size()
            if n == 0:
                spans.append((0, 0))
                continue
            p = t.data_ptr()
            if t.device.type != "cpu" or not t.is_contiguous() or p < base or p + n > end:
                return None
            spans.append((p - base, n))
        return spans

    def write_from_arena(
        self,
        storage: Storage,
        fname: str,
        keys: list[str],
        chunks: Sequence[tuple[str, Box, Any]],
        metadata: dict[str, str],
    ) -> tuple[list[tuple[int, int, str]], int] | None:
        """Have the writer process write data file ``fname`` (:func:`ckpt.format.publish.write_data_file`'s
        ``elsewhere``): ``((offset, nbytes, checksum) of each chunk, file size)``, or None when the bytes are not
        all in the shared arena or the storage is not a local folder (the caller then writes the file itself)."""
        spans = self._spans(chunks) if type(storage) is LocalStorage else None
        if spans is None:
            return None
        req = {
            "root": storage.root,
            "fname": fname,
            "entries": [raw_entry(Chunk(k, t)) for k, (_, _, t) in zip(keys, chunks, strict=True)],
            "spans": spans,
            "metadata": metadata,
            "direct": self.direct_io,
        }
        writer = self._start_writer()  # a writer that died since the last save is replaced
        nbytes = sum(n for _, n in spans)
        with self._lock:
            reply = writer.request(req, self.writer_timeout_s + nbytes / 50e6)
        if not reply["ok"] and reply.get("errno"):
            raise OSError(reply["errno"], os.strerror(reply["errno"]), reply.get("filename") or storage.path(fname))
        if not reply["ok"]:
            raise StorageError(f"writer process, {storage.display(fname)}: {reply['error']}")
        for k, v in reply["io"].items():
            self.io[k] = self.io.get(k, 0) + int(v)
        return [(int(o), int(n), str(d)) for o, n, d in reply["placed"]], int(reply["size"])


def default_stager(async_save: bool) -> HostStager:
    """The stager a checkpointer uses when given none: for asynchronous saves a :class:`ProcessStager` where the
    platform can share an anonymous arena (``os.memfd_create``: Linux), else the in-process :class:`HostStager`."""
    if async_save and hasattr(os, "memfd_create"):
        return ProcessStager()
    return HostStager()


def _pin(arena: torch.Tensor) -> bool:
    """Page-lock ``arena`` in place for DMA from CUDA (as pinned memory is); False when CUDA refuses."""
    if not torch.cuda.is_available():
        return False
    # flag 1: cudaHostRegisterPortable, as DCP's shared-memory stager registers its storages
    return int(torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 1)) == 0


def _close_all(writers: list[_Writer]) -> None:
    for w in writers:
        w.stop()
