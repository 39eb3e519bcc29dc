"""Moving whole files between ranks over the tier's gloo group (CPU): host bytes, whatever device trained.

Both sides know every file's size from the step's manifest, so only the bytes travel; the senders' xxh3 of
every file they send is gathered first (:func:`sent_digests`), so a receiver also catches damage the manifest's
checksums do not cover (a data file's safetensors header).  All sends and receives of
one exchange are posted at once (``isend``/``irecv``): every rank may send and receive in the same exchange without
a global order, and messages between two ranks arrive in the order they were posted.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def read_or_zeros(path: Path, size: int, problems: list[str]) -> bytes:
    """The bytes to send of ``path``; when it cannot be read, ``size`` zeros (the receiver waits for exactly that
    many, and its check refuses them) and the reason appended to ``problems``: a sender never leaves its peers
    waiting."""
    try:
        data = path.read_bytes()
    except OSError as e:
        problems.append(f"{path}: cannot read: {e.strerror or type(e).__name__}")
        return bytes(size)
    if len(data) != size:
        problems.append(f"{path}: {len(data)} bytes, the manifest says {size}")
        return bytes(size)
    return data


def sent_digests(coll: Any, files: dict[str, bytes]) -> dict[str, str]:
    """Every rank's ``{name: xxh3}`` of the files it is about to send, merged (collective)."""
    from ..format.codecs import checksum

    out: dict[str, str] = {}
    for part in coll.all_gather({n: checksum(d) for n, d in files.items()}):
        out.update(part)
    return out


def check_received(name: str, data: bytes, digests: dict[str, str], where: str) -> str | None:
    """None when ``data`` is what its sender hashed, else one line naming the file."""
    from ..format.codecs import checksum

    got = checksum(data)
    return (
        None
        if got == digests.get(name)
        else f"{where}: damaged in transit (sent {digests.get(name)}, got {got})"
    )


def store_received(
    storage: Any,
    folder: Path,
    m: Any,
    names: Sequence[str],
    received: Sequence[bytes],
    digests: dict[str, str],
) -> list[str]:
    """Publish each received file that its sender's digest confirms into ``storage`` (the folder ``folder``), then
    check them all against the manifest ``m``; returns the problems (a refused file is not written)."""
    from .files import FileChecker

    problems = []
    for name, data in zip(names, received, strict=True):
        bad = check_received(name, data, digests, str(folder / name))
        if bad is not None:
            problems.append(bad)
            continue
        storage.put_bytes(name, data, exclusive=False)
    checker = FileChecker(storage, m)
    return problems + [e for e in map(checker.check, names) if e is not None]


def exchange(group: Any, sends: Sequence[tuple[int, bytes]], recvs: Sequence[tuple[int, int]]) -> list[bytes]:
    """Send each ``(rank, data)`` and receive each ``(rank, size)``; returns the received bytes in ``recvs`` order.

    Ranks are global ranks (the tier group spans the world).  Empty files are not sent.
    """
    works = []
    for dst, data in sends:
        if len(data):
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            works.append(dist.isend(buf, dst=dst, group=group))
    out: list[torch.Tensor] = []
    for src, size in recvs:
        buf = torch.empty(size, dtype=torch.uint8)
        out.append(buf)
        if size:
            works.append(dist.irecv(buf, src=src, group=group))
    for w in works:
        w.wait()
    return [b.numpy().tobytes() for b in out]
