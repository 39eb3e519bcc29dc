"""The background half of a local save, on every rank, once the checkpointer committed the step into a hidden
pending folder of each node (``<local_dir>/.pending/step_<N>-<id>``; the manifest there is on rank 0's node only):

1. rank 0's manifest goes to every node's leader, who puts it in its node's pending folder;
2. every rank sends the files it wrote to the same local rank on the next ``replicas`` nodes and receives those of
   the previous ones (:mod:`.transfer`: no copy of a file on either side); a received file gets its name only
   once it hashes to what its sender hashed, and is then checked against the manifest before it counts;
3. only when every rank's data and replicas are sealed does each node's leader rename the pending folder to
   ``step_<N>``: the local commit.  A crash before that leaves nothing that looks committed;
4. a step that also goes to the persistent tier is copied there from the local folders, each rank its own files,
   rank 0 the manifest last (create-only), as any save commits.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointExistsError, CkptError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..restoring.discovery import step_dir
from ..storage import Storage, open_storage, refusal
from .files import check_files, file_size, rank_files
from .node import NodeMap
from .retention import drop
from .transfer import Receive, Send, transfer


def share_manifest(coll: Any, nodes: NodeMap, folder: Path) -> tuple[bytes, Manifest]:
    """Rank 0's ``manifest.json`` of ``folder`` on every rank, and written into every node's copy of it."""
    raw = coll.broadcast((folder / MANIFEST_NAME).read_bytes() if coll.rank == 0 else None)
    m = Manifest.from_json(raw, str(folder / MANIFEST_NAME))
    if nodes.rank == nodes.leader(nodes.node) and not (folder / MANIFEST_NAME).exists():
        open_storage(str(folder)).put_bytes(MANIFEST_NAME, raw, exclusive=True)
    return raw, m


def send_replicas(coll: Any, nodes: NodeMap, replicas: int, folder: Path, m: Manifest) -> list[str]:
    """Step 2 of the module docstring; returns this rank's problems (empty: its replicas are sealed)."""
    if not replicas:  # nothing to send: never map the files
        return []
    sends = [
        Send(n, folder / n, file_size(m, n), nodes.peer(nodes.rank, k))
        for k in range(1, replicas + 1)
        for n in rank_files(m, nodes.rank)
    ]
    recvs = []
    for k in range(1, replicas + 1):
        src = nodes.source_of(nodes.rank, k)
        recvs += [Receive(n, folder / n, file_size(m, n), src) for n in rank_files(m, src)]
    got = transfer(coll, sends, recvs)
    return got.problems + check_files(open_storage(str(folder)), m, got.kept)


def commit(nodes: NodeMap, pending: Path, final: Path) -> None:
    """Step 3: the node leader renames the pending folder (a step folder already there, from a timeline a restore
    abandoned, is replaced)."""
    if nodes.rank != nodes.leader(nodes.node):
        return
    if final.exists():
        drop(final)
    os.rename(pending, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def persist(coll: Any, root: Storage, step: int, folder: Path, raw: bytes, m: Manifest) -> str:
    """Step 4: copy the step to ``root`` (collective); returns the persistent step's URL."""
    dst = root.child(step_dir(step))
    exists = coll.broadcast(dst.exists(MANIFEST_NAME) if coll.rank == 0 else None)
    if exists:
        raise CheckpointExistsError(f"{dst.display(MANIFEST_NAME)} already exists: step {step} is committed")
    error = None
    try:
        for n in rank_files(m, coll.rank):
            dst.put_bytes(n, (folder / n).read_bytes(), exclusive=True)
    except Exception as e:  # noqa: BLE001 - every rank must learn it before rank 0 would commit
        error = f"rank {coll.rank}: {refusal.reason(e, dst.display()) or f'{type(e).__name__}: {e}'}"
    errors = [e for e in coll.all_gather(error) if e is not None]
    outcome = None
    if coll.rank == 0 and not errors:
        try:
            dst.put_bytes(MANIFEST_NAME, raw, exclusive=True)
        except Exception as e:  # noqa: BLE001
            outcome = f"rank 0 commit: {refusal.reason(e, dst.display()) or f'{type(e).__name__}: {e}'}"
    outcome = coll.broadcast(outcome if not errors else "; ".join(errors))
    if outcome is not None:
        raise CkptError(f"copy of step {step} to {dst.display()} failed, not committed: {outcome}")
    return dst.display()
