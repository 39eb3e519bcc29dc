"""Moving whole files between ranks over the tier's gloo group (CPU): host bytes, whatever device trained.

:func:`transfer` is the one path both a save's replicas (:mod:`.replicate`) and a restore's fetches (:mod:`.agree`)
take.  It copies no file on the host: a sent file is mapped and handed to gloo as it lies (:mod:`.outgoing`), a
received one is written by gloo straight into a temp file beside its final name (:mod:`.landing`).  The training
process's own CPU time and GIL hold for a replica are then the hashing and the system calls, not four copies.

Both sides know every file's size from the step's manifest, so only the bytes travel; the senders' xxh3 of every
file they send is gathered first (:func:`sent_digests`), so a receiver also catches damage the manifest's checksums
do not cover (a data file's safetensors header), and publishes nothing it could not confirm.  All sends and
receives of one exchange are posted at once (``isend``/``irecv``): every rank may send and receive in the same
exchange without a global order, and messages between two ranks arrive in the order they were posted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .landing import Landing
from .outgoing import Outgoing


@dataclass(frozen=True)
class Send:
    """Send the file ``path`` (``name`` in the manifest, ``size`` bytes by it) to global rank ``dst``."""

    name: str
    path: Path
    size: int
    dst: int


@dataclass(frozen=True)
class Receive:
    """Receive ``name`` (``size`` bytes) from global rank ``src`` into the file ``path``."""

    name: str
    path: Path
    size: int
    src: int


@dataclass
class Result:
    """What one rank's part of a transfer gave: the received files published under their names (``kept``), and
    every problem of this rank's (files it could not send as the manifest says, files it refused)."""

    kept: list[str]
    problems: list[str]


def sent_digests(coll: Any, digests: dict[str, str | None]) -> list[dict[str, str | None]]:
    """Every rank's ``{name: xxh3}`` of the files it is about to send, by rank (collective).  None: the sender
    could not read that file as the manifest describes it (it sends zeros, which no receiver keeps)."""
    return list(coll.all_gather(digests))


def transfer(coll: Any, sends: Sequence[Send], recvs: Sequence[Receive]) -> Result:
    """This rank's sends and receives of one exchange (collective: every rank of ``coll`` calls it, with matching
    sends and receives).  A received file is published only when it hashes to what its sender hashed."""
    out: dict[Path, Outgoing] = {}
    problems: list[str] = []
    for s in sends:
        if s.path not in out:
            out[s.path] = o = Outgoing(s.path, s.size)
            if o.problem is not None:
                problems.append(o.problem)
    digests = sent_digests(coll, {s.name: out[s.path].digest for s in sends})
    landings = [Landing(r.path, r.size) for r in recvs]
    try:
        works = [dist.isend(out[s.path].tensor, dst=s.dst, group=coll.group) for s in sends if s.size]
        works += [
            dist.irecv(ln.tensor, src=r.src, group=coll.group)
            for r, ln in zip(recvs, landings, strict=True)
            if r.size
        ]
        for w in works:
            w.wait()
    except BaseException:
        # gloo may still hold the buffers: drop the temp files, leave the mappings to the garbage collector
        for ln in landings:
            ln.discard(unmap=False)
        raise
    del works
    for o in out.values():
        o.close()
    kept = []
    for r, ln in zip(recvs, landings, strict=True):
        bad = ln.publish(digests[r.src].get(r.name))
        if bad is None:
            kept.append(r.name)
        else:
            problems.append(bad)
    return Result(kept, problems)
