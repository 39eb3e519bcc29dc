"""The persistent writer process: writes data files from the staging arena it shares with the trainer.

Started by :class:`ckpt.saving.process_writer.ProcessStager` as ``python -m ckpt.saving.writer_child ARENA_FD
LIFELINE_FD``; it imports no torch.  Requests arrive one JSON line at a time on stdin (which file, where each
chunk's bytes lie in the arena, the header entries), replies leave on stdout: where each chunk landed and its
checksum, or the error.  The file is written through :class:`~ckpt.storage.local.LocalStorage` (temp file, fsync,
create-only link) with direct I/O straight from the arena where the file system allows it
(:mod:`ckpt.format.directwrite`: no copy into the page cache), each block hashed right before it is written, so it
is byte for byte what the in-process writer produces and a half-written file is never published.

It dies with its job: a thread blocks on the lifeline pipe, whose write end only the trainer holds; when the
trainer exits for any reason (``kill -9`` included) the read returns and this process exits at once, mid-write
or not (leaving at most a hidden temp file, and no manifest: only the trainer commits).
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import threading
from typing import Any

from ckpt.format.codecs import StreamingChecksum
from ckpt.format.directwrite import (
    DirectIOUnsupported,
    disable_direct,
    enable_direct,
    new_bounce,
    write_direct,
)
from ckpt.format.streamwrite import safetensors_header, write_payloads
from ckpt.storage.local import LocalStorage
from ckpt.storage.refusal import refusal_in


def _watch(lifeline: int) -> None:
    while True:
        try:
            if not os.read(lifeline, 1):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    os._exit(3)


_BOUNCE: list[mmap.mmap] = []  # the direct writer's bounce buffer, made at the first file


def serve(arena: memoryview, req: dict[str, Any]) -> dict[str, Any]:
    """Write one data file (``req``: root, fname, entries, spans, metadata, direct); return where each payload
    landed and how many bytes went to the disk straight from the arena (direct I/O), through the bounce buffer, or
    buffered (a file system that refuses direct I/O, or ``direct`` false)."""
    head = safetensors_header([tuple(e) for e in req["entries"]], req["metadata"])
    spans = [(int(o), int(n)) for o, n in req["spans"]]
    io = {"direct": 0, "bounced": 0, "buffered": 0}
    with LocalStorage(req["root"]).create(req["fname"], borrow=True) as f:
        placed = None
        if req.get("direct", True) and enable_direct(f.fileno()):
            if not _BOUNCE:
                _BOUNCE.append(new_bounce())
            try:
                placed, size, stats = write_direct(f.fileno(), head, arena, spans, _BOUNCE[0])
                io.update(direct=stats.direct, bounced=stats.bounced)
            except DirectIOUnsupported:  # e.g. a block larger than ALIGN: start over, buffered
                disable_direct(f.fileno())
                os.ftruncate(f.fileno(), 0)
                f.seek(0)
        if placed is None:
            placed, size = write_payloads(f, head, [arena[o : o + n] for o, n in spans])
            io["buffered"] = size
    return {"placed": placed, "size": size, "io": io}


def seal_in_place(req: dict[str, Any]) -> dict[str, Any]:
    """The memory tier's write (:mod:`ckpt.tiers.memory`): the arena is a named shared-memory file whose payloads
    already lie at their data-file offsets.  Hash each payload where it lies, write the header before them, and
    link the file into the step folder as data file ``fname`` (create-only): no byte is copied or written again."""
    head = safetensors_header([tuple(e) for e in req["entries"]], req["metadata"])
    fd = os.open(req["link"], os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        pos, placed = len(head), []
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        try:
            view = memoryview(mm)
            for (o, n), e in zip(req["spans"], req["entries"], strict=True):
                if (n and o != pos) or n != e[3]:
                    raise ValueError(
                        f"payload {e[0]} lies at {o}+{n} in {req['link']}, expected {pos}+{e[3]}"
                    )
                h = StreamingChecksum()
                for start in range(pos, pos + n, 1 << 24):
                    h.update(view[start : min(start + (1 << 24), pos + n)])
                placed.append((pos, n, h.hexdigest()))
                pos += n
            view.release()
        finally:
            mm.close()
        if pos != size:
            raise ValueError(f"{req['link']}: {size} bytes, the data file is {pos}")
        os.pwrite(fd, head, 0)
    finally:
        os.close(fd)
    os.link(req["link"], os.path.join(req["root"], req["fname"]))  # create-only: EEXIST if a file is there
    return {"placed": placed, "size": pos, "io": {"direct": 0, "bounced": 0, "buffered": 0, "linked": pos}}


def main(argv: list[str]) -> int:
    arena_fd, lifeline = int(argv[0]), int(argv[1])
    threading.Thread(target=_watch, args=(lifeline,), name="lifeline", daemon=True).start()
    size = os.fstat(arena_fd).st_size
    mm = mmap.mmap(arena_fd, size, prot=mmap.PROT_READ) if size else None
    arena = memoryview(mm) if mm is not None else memoryview(b"")
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        line = stdin.readline()
        if not line:
            return 0
        try:
            req = json.loads(line)
            reply: dict[str, Any] = {
                "ok": True,
                **(seal_in_place(req) if req.get("link") else serve(arena, req)),
            }
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which does not commit
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            refused = refusal_in(e)  # a full disk: the trainer raises it as the OSError it is
            if refused is not None:
                reply.update(errno=refused.errno, filename=refused.filename)
        stdout.write(json.dumps(reply).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
