"""The persistent writer process: writes data files from the staging arena it shares with the trainer.

Started by :class:`ckpt.saving.process_writer.ProcessStager` as ``python -m ckpt.saving.writer_child ARENA_FD
LIFELINE_FD``; it imports no torch.  Requests arrive one JSON line at a time on stdin (which file, where each
chunk's bytes lie in the arena, the header entries), replies leave on stdout: where each chunk landed and its
checksum, or the error.  The file is written through :class:`~ckpt.storage.local.LocalStorage` (temp file, fsync,
create-only link), each block hashed right before it is written, so it is byte for byte what the in-process
writer produces and a half-written file is never published.

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

from ckpt.format.streamwrite import safetensors_header, write_payloads
from ckpt.storage.local import LocalStorage


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


def serve(arena: memoryview, req: dict[str, Any]) -> dict[str, Any]:
    """Write one data file (``req``: root, fname, entries, spans, metadata); return where each payload landed."""
    head = safetensors_header([tuple(e) for e in req["entries"]], req["metadata"])
    payloads = [arena[o : o + n] for o, n in req["spans"]]
    with LocalStorage(req["root"]).create(req["fname"], borrow=True) as f:
        placed, size = write_payloads(f, head, payloads)
    return {"placed": placed, "size": size}


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
            reply: dict[str, Any] = {"ok": True, **serve(arena, json.loads(line))}
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which does not commit
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        stdout.write(json.dumps(reply).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
