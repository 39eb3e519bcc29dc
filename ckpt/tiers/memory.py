"""The host-memory tier: each rank's newest steps live in shared memory (``/dev/shm``) that outlives the trainer.

``CheckpointManager(root, local_dir="/dev/shm/ckpt", local_memory=True, ...)`` makes the local tier a memory tier.
Its saves go through the same checkpointer, commit and replicas as any local save (:mod:`.replicate`), so a step
looks complete exactly when it is (its ``manifest.json`` is written last, by the commit), and a restarted trainer
on the node adopts the newest one through the ordinary restore (``restore_latest``: same run id, :mod:`.runid`).
What changes is where the bytes go:

* the staging arena the writer process reads (:class:`~ckpt.saving.process_writer.ProcessStager`) is a *named*
  file of the tier's folder (``run-<id>/.arena/r<rank>-<pid>-<slot>``), two of them used in turn: at most two
  snapshots per rank;
* each saved tensor is copied into the arena at the very offset it has in the data file (one copy, lazily beside
  the next forward/backward as any async save);
* the writer process hashes the payloads where they lie, writes the header in front of them and hard-links the
  arena into the step folder as the rank's data file (``writer_child.seal_in_place``): no second copy, no write.

Before an arena is reused, the step whose data file it is (two saves ago) loses its manifest, so it never looks
complete while its bytes are overwritten; a kill in the middle of a save leaves the newest committed step intact
in the other arena.  A step being copied to the persistent tier keeps its arena (``pin``) until the copy is done;
meanwhile the saves reuse the other one.

The memory this needs is checked at the first save (:func:`check_room`): one line naming what cannot hold it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import CkptError
from ..format.manifest import MANIFEST_NAME, Box
from ..saving.process_writer import ProcessStager, _pin
from ..storage import Storage
from ..storage.local import LocalStorage

#: file systems whose files live in host memory
MEMORY_FS = ("tmpfs", "ramfs")
SLOTS = 2
ARENA = ".arena"


def fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path`` (``/proc/mounts``; "" where it cannot be read)."""
    target, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return ""
    for mnt, fs in mounts:
        mnt = mnt.replace("\\040", " ")
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, fs
    return kind


def check_memory_dir(local_dir: Path) -> None:
    """Refuse a ``local_dir`` whose files would not live in host memory."""
    probe = local_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    kind = fs_type(probe)
    if kind not in MEMORY_FS:
        raise CkptError(
            f"local_memory=True: local_dir={str(local_dir)!r} is on {kind or 'an unknown file system'}, expected a "
            f"memory file system ({' or '.join(MEMORY_FS)}, e.g. /dev/shm)"
        )


def mem_available() -> int | None:
    """Host memory the kernel can still hand out (``MemAvailable``), bytes; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_room(folder: Path, need: int, held: int, what: str) -> None:
    """Refuse (one line) when ``folder``'s file system or host memory cannot hold ``need`` more bytes; ``held``:
    bytes this tier already holds there and will reuse."""
    more = max(need - held, 0)
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    avail = mem_available()
    gib = 2**30
    if more > free:
        raise CkptError(
            f"local_memory: {folder} has {free / gib:.2f} GiB free, {what} need {more / gib:.2f} GiB more "
            "(grow /dev/shm, e.g. mount -o remount,size=..., or save less per node)"
        )
    if avail is not None and more > avail:
        raise CkptError(
            f"local_memory: host memory has {avail / gib:.2f} GiB available, {what} need {more / gib:.2f} GiB more"
        )


class MemoryStager(ProcessStager):
    """A :class:`ProcessStager` whose arenas are named files of the memory tier (module docstring).

    ``folder`` is set by the tiers before the first save (this run's ``.arena`` folder); ``per_node`` is how many
    arenas' worth the node holds per rank's (ranks on the node x (1 + replicas)), for the room check."""

    def __init__(self, rank: int, per_node: int = 1, writer_timeout_s: float = 120.0) -> None:
        super().__init__(direct_io=False, writer_timeout_s=writer_timeout_s)
        self.rank = rank
        self.per_node = per_node
        self.folder: Path | None = None
        self._slots: list[dict[str, Any]] = [{} for _ in range(SLOTS)]
        self._cur = -1  # the slot of the save in progress / last save
        self._pinned: set[int] = set()
        self._exact = False  # the current layout puts every tensor at its file offset
        self._checked = False

    # ------------------------------------------------------------------------------------------------ slots
    def _next_slot(self) -> int:
        free = [k for k in range(SLOTS) if k != self._cur and k not in self._pinned]
        return free[0] if free else max(self._cur, 0)

    def pin(self) -> int:
        """Keep the last save's arena (a persistent copy reads it); returns the slot for :meth:`unpin`."""
        self._pinned.add(self._cur)
        return self._cur

    def unpin(self, slot: int) -> None:
        self._pinned.discard(slot)

    def _invalidate(self, slot: dict[str, Any]) -> None:
        """The step whose data file this arena is loses its manifest before the arena is overwritten."""
        for data in slot.pop("linked", []):
            try:
                Path(data).parent.joinpath(MANIFEST_NAME).unlink()
            except FileNotFoundError:
                pass
            # the folder may have been renamed since (pending -> step_<N>): find the link by its inode
            ino = slot.get("ino")
            if ino is not None and self.folder is not None:
                for step in self.folder.parent.glob("step_*"):
                    f = step / Path(data).name
                    try:
                        if f.stat().st_ino == ino:
                            (step / MANIFEST_NAME).unlink(missing_ok=True)
                    except FileNotFoundError:
                        pass

    def _arena_for(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if self.folder is None:  # no tier folder yet: a plain shared arena
            return super()._arena_for(nbytes, pinned)
        k = self._next_slot()
        slot = self._slots[k]
        self._invalidate(slot)
        if not self._checked:
            self._checked = True
            self.folder.mkdir(parents=True, exist_ok=True)
            held = sum(s.get("size", 0) for s in self._slots)
            check_room(self.folder, SLOTS * nbytes * self.per_node, held,
                       f"{SLOTS} snapshots x {self.per_node} per rank of {nbytes / 2**30:.3f} GiB")  # fmt: skip
        if slot.get("size") != nbytes:
            self._open_slot(slot, k, nbytes)
        self._cur = k
        self._switch(slot)
        if pinned and not slot.get("pinned"):
            # CUDA state: the slot's pages are page-locked in place so device-to-host copies run as DMA
            if not _pin(slot["arena"]):  # CUDA refuses: a plain pinned arena, written as any save's
                self._fd, self._map, self._arena = -1, None, None
                return super()._arena_for(nbytes, pinned)
            slot["pinned"] = True
        assert self._arena is not None
        return self._arena

    def _open_slot(self, slot: dict[str, Any], k: int, nbytes: int) -> None:
        """A fresh arena file of exactly ``nbytes`` (the data file's size); the old one's name is dropped (its
        bytes live on while a step folder links them)."""
        assert self.folder is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        if slot.get("path"):
            _unpin(slot)
            Path(slot["path"]).unlink(missing_ok=True)
            os.close(slot["fd"])
        path = self.folder / f"r{self.rank:05d}-{os.getpid()}-{k}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.ftruncate(fd, nbytes)
        slot.update(path=str(path), fd=fd, size=nbytes, ino=os.fstat(fd).st_ino, map=None, arena=None)

    def _switch(self, slot: dict[str, Any]) -> None:
        import mmap

        if slot.get("arena") is None:
            slot["map"] = mmap.mmap(slot["fd"], slot["size"])
            slot["arena"] = torch.frombuffer(slot["map"], dtype=torch.uint8)
        self._fd, self._map, self._arena = slot["fd"], slot["map"], slot["arena"]

    def drop_stale(self) -> None:
        """Remove this rank's arena names left by an earlier process of this run (a killed trainer): their bytes
        stay while a step folder links them, and are freed with it."""
        if self.folder is None or not self.folder.is_dir():
            return
        mine = {s.get("path") for s in self._slots}
        for f in self.folder.glob(f"r{self.rank:05d}-*"):
            if str(f) not in mine:
                f.unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------------------ layout
    def _places(self, tensors: Sequence[torch.Tensor], file_offsets: Sequence[int] | None) -> list[int]:
        """Every tensor at its data-file offset when each suits its dtype; else the writer's own layout (the file
        is then written, as by any process-writer save)."""
        if file_offsets is not None and all(
            o % t.element_size() == 0 for t, o in zip(tensors, file_offsets, strict=True)
        ):
            self._exact = True
            return list(file_offsets)
        self._exact = False
        return super()._places(tensors, file_offsets)

    def _views(
        self, tensors: Sequence[torch.Tensor], file_offsets: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        places = self._places(tensors, file_offsets)
        if not self._exact or self.folder is None:
            return super()._views(tensors, file_offsets)
        sizes = [t.numel() * t.element_size() for t in tensors]
        end = max((p + n for p, n in zip(places, sizes, strict=True)), default=0)
        end = max(end, file_offsets[0] if file_offsets else 0)
        arena = self._arena_for(end, pinned=any(t.is_cuda for t in tensors) and torch.cuda.is_available())
        if arena.numel() != end or self._fd != self._slots[self._cur].get("fd"):
            self._exact = False
        return [
            arena[p : p + n].view(t.dtype).view(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
            for t, p, n in zip(tensors, places, sizes, strict=True)
        ]

    # ------------------------------------------------------------------------------------------------ writing
    def write_from_arena(
        self,
        storage: Storage,
        fname: str,
        keys: list[str],
        chunks: Sequence[tuple[str, Box, Any]],
        metadata: dict[str, str],
    ) -> tuple[list[tuple[int, int, str]], int] | None:
        """Seal the arena in place and link it as data file ``fname`` (module docstring); the process writer's
        own write when the layout or the storage does not allow it."""
        slot = self._slots[self._cur] if self._cur >= 0 else {}
        spans = self._spans(chunks) if type(storage) is LocalStorage else None
        if not (self._exact and spans is not None and slot.get("fd") == self._fd):
            return super().write_from_arena(storage, fname, keys, chunks, metadata)
        os.makedirs(storage.root, exist_ok=True)
        if os.stat(storage.root).st_dev != os.fstat(self._fd).st_dev:
            return super().write_from_arena(storage, fname, keys, chunks, metadata)
        from ..format.datafile import Chunk, raw_entry

        req = {
            "root": storage.root,
            "fname": fname,
            "entries": [raw_entry(Chunk(k, t)) for k, (_, _, t) in zip(keys, chunks, strict=True)],
            "spans": spans,
            "metadata": metadata,
            "link": slot["path"],
        }
        writer = self._start_writer()
        nbytes = sum(n for _, n in spans)
        with self._lock:
            reply = writer.request(req, self.writer_timeout_s + nbytes / 200e6)
        if not reply["ok"]:
            raise CkptError(f"memory tier, {storage.display(fname)}: {reply['error']}")
        slot.setdefault("linked", []).append(os.path.join(storage.root, fname))
        for k, v in reply["io"].items():
            self.io[k] = self.io.get(k, 0) + int(v)
        return [(int(o), int(n), str(d)) for o, n, d in reply["placed"]], int(reply["size"])

    def _drop_shared(self) -> None:
        if any(s.get("fd") == self._fd for s in self._slots):  # a slot's arena: its file stays the slot's
            self._fd, self._map, self._arena = -1, None, None
        super()._drop_shared()

    def release(self) -> None:
        """Free the arenas' mappings and names (steps that link them keep their bytes)."""
        self._fd, self._map, self._arena = -1, None, None
        with self._lock:
            if self._writer is not None:
                self._writer.stop()
                self._writer = None
        for s in self._slots:
            _unpin(s)
            s["arena"] = s["map"] = None
            if s.get("fd") is not None:
                os.close(s["fd"])
            if s.get("path"):
                Path(s["path"]).unlink(missing_ok=True)
            s.clear()
        self._cur = -1


def _unpin(slot: dict[str, Any]) -> None:
    """Undo :func:`~ckpt.saving.process_writer._pin` of a slot's arena (before it is unmapped)."""
    if slot.pop("pinned", False) and slot.get("arena") is not None:
        torch.cuda.cudart().cudaHostUnregister(slot["arena"].data_ptr())
