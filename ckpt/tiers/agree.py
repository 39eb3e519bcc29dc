"""Which step every rank restores, and from where: all ranks agree on one plan, never a mix of steps.

1. Inventory (every rank, collective): each node's local steps, their manifest's seal, and which of their files
   hold exactly the bytes the manifest describes (:class:`~.files.FileChecker`; a node's ranks split the files).
2. Plan (rank 0): a local step is restorable when every file it lists is intact on some node.  Each node then needs
   the files it lacks (or holds damaged), fetched from a node holding them; a rank's tier is ``local`` when its
   node held its own files, ``peer`` when they come from a replica.  Persistent steps (rank 0 lists the root) follow
   at equal steps, and every older candidate follows in turn, so a failure falls back together.
3. Fetch (every rank, per candidate): the transfers of the plan over the tier group (:func:`.transfer.transfer`:
   no copy of a file on either side), each file checked on receipt;
   a node without the step assembles it in a hidden folder and renames it into place once everything arrived.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CkptError
from ..format.manifest import MANIFEST_NAME, SEAL_RE, Box, Manifest
from ..restoring.discovery import step_dir
from ..storage import open_storage
from .files import FileChecker, all_files, check_files, file_size, rank_files
from .node import NodeMap
from .policy import LOCAL, PEER, PERSISTENT
from .retention import FETCH, drop, local_steps
from .runid import step_run_id
from .transfer import Receive, Send, transfer


@dataclass
class Candidate:
    """One step to try: ``tier`` ``local`` (files on the nodes, maybe fetched) or ``persistent``."""

    step: int
    tier: str
    raw: bytes | None = None  # the local step's manifest
    transfers: list[tuple[int, int, str]] = field(default_factory=list)  # (from rank, to rank, file)
    tiers: list[str] = field(default_factory=list)  # per rank: local / peer
    #: every file held was checked against its checksums by the inventory (fetched ones are checked on receipt):
    #: the restore reads them without verifying again
    checked: bool = False
    note: str = ""


def inventory(nodes: NodeMap, root: Path, run_id: str) -> dict[int, dict[str, Any]]:
    """This rank's share of its node's inventory (module docstring, 1) of run ``run_id``'s folder ``root``; a step
    whose manifest records another run id or none is left out (:func:`.runid.foreign_steps` names it)."""
    out: dict[int, dict[str, Any]] = {}
    leader = nodes.rank == nodes.leader(nodes.node)
    deep = (
        True  # checksums for the newest steps down to the first one this rank holds intact; below it, sizes
    )
    for step in reversed(local_steps(root)):
        folder = root / step_dir(step)
        if step_run_id(folder) != run_id:
            continue
        try:
            raw = (folder / MANIFEST_NAME).read_bytes()
            m = Manifest.from_json(raw, str(folder / MANIFEST_NAME))
        except (CkptError, OSError) as e:
            out[step] = {"seal": None, "error": str(e)}
            continue
        if m.step != step:
            out[step] = {"seal": None, "error": f"{folder}: manifest says step {m.step}"}
            continue
        checker = FileChecker(open_storage(str(folder)), m)
        present = set(os.listdir(folder))
        held, bad = [], []
        for i, name in enumerate(all_files(m)):
            if i % nodes.local_size != nodes.local_rank or name not in present:
                continue
            err = checker.check(name) if deep else _size_check(folder / name, file_size(m, name))
            (held if err is None else bad).append(name if err is None else err)
        seal = SEAL_RE.match(raw)
        out[step] = {"seal": seal.group(1) if seal else None, "held": held, "bad": bad, "checked": deep}
        deep = deep and bool(bad)
        if leader:
            out[step]["raw"] = raw
    return out


def _size_check(path: Path, size: int) -> str | None:
    """An older step's file below the newest intact one: its size only (its checksums are verified as the restore
    reads it, should it come to that step; damage then falls back together)."""
    try:
        got = path.stat().st_size
    except OSError as e:
        return f"{path}: cannot read: {e.strerror or type(e).__name__}"
    return None if got == size else f"{path}: {got} bytes, the manifest says {size}"


def plan(nodes: NodeMap, reports: list[dict[int, dict[str, Any]]], persistent: list[int]) -> list[Candidate]:
    """Rank 0: every candidate, newest first (module docstring, 2); warnings name what was skipped and why."""
    n_nodes = len(nodes.nodes)
    steps = sorted({s for r in reports for s in r}, reverse=True)
    local: list[Candidate] = []
    for step in steps:
        per_node: dict[int, list[dict[str, Any]]] = {}
        for rank, rep in enumerate(reports):
            if step in rep:
                per_node.setdefault(nodes.node_of(rank), []).append(rep[step])
        seals: dict[str, int] = {}
        for entries in per_node.values():
            for e in entries:
                if e["seal"] is not None:
                    seals[e["seal"]] = seals.get(e["seal"], 0) + 1
        if not seals:
            local.append(Candidate(step, "", note=f"local step {step}: no readable manifest on any node"))
            continue
        raws = {e["seal"]: e["raw"] for es in per_node.values() for e in es if "raw" in e and e["seal"]}
        if not raws:
            local.append(Candidate(step, "", note=f"local step {step}: no node leader read its manifest"))
            continue
        # nodes may hold two saves of one step (a commit cut short after a restore abandoned the first): the
        # newer one, never parts of both
        parsed = {s: Manifest.from_json(r, f"{step_dir(step)}/{MANIFEST_NAME}") for s, r in raws.items()}
        seal = max(parsed, key=lambda s: (parsed[s].created_at, seals.get(s, 0), s))
        raw, m = raws[seal], parsed[seal]
        holders: dict[str, set[int]] = {}
        for node, entries in per_node.items():
            if all(e["seal"] == seal for e in entries):  # a node with another manifest holds another save
                for e in entries:
                    for name in e["held"]:
                        holders.setdefault(name, set()).add(node)
        files = all_files(m)
        lost = [f for f in files if not holders.get(f)]
        if lost:
            bad = [b for es in per_node.values() for e in es for b in e.get("bad", ())]
            why = f"; damaged copies: {'; '.join(bad[:2])}" if bad else ""
            local.append(
                Candidate(
                    step, "", note=f"local step {step}: no node holds an intact {', '.join(lost[:3])}{why}"
                )
            )
            continue
        cand = Candidate(step, LOCAL, raw)
        cand.checked = all(e.get("checked", False) for es in per_node.values() for e in es)
        for node in range(n_nodes):
            members = nodes.nodes[node]
            for i, name in enumerate(files):
                if node in holders[name]:
                    continue
                src = min(holders[name], key=lambda h: (h - node) % n_nodes)
                src_members = nodes.nodes[src]
                cand.transfers.append((src_members[i % len(src_members)], members[i % len(members)], name))
        for rank in range(sum(len(m_) for m_ in nodes.nodes)):
            own = rank_files(m, rank)
            cand.tiers.append(LOCAL if all(nodes.node_of(rank) in holders[f] for f in own) else PEER)
        local.append(cand)
    out = [c for c in local if c.tier] + [Candidate(s, PERSISTENT) for s in persistent]
    skipped = [c for c in local if not c.tier]
    # newest first; at one step the local copy before the persistent one
    out.sort(key=lambda c: (-c.step, c.tier != LOCAL))
    return skipped + out


def wanted(m: Manifest, boxes: dict[str, Box] | None) -> set[str] | None:
    """The files a rank reads to restore its ``boxes`` (tensor name -> the box it holds live) of step ``m``: every
    index and state file (small; the reader loads every index), and the data files of the ranks whose pieces
    overlap its boxes (an optimizer state tensor shaped like its parameter: the parameter's box; anything else:
    the whole tensor).  None, meaning every file, for a version 1 manifest or unknown boxes."""
    if m.v2 is None or boxes is None:
        return None
    writers: set[int] = set()
    for name, t in m.tensors.items():
        spec = m.v2.pieces.get(name)
        if spec is None:
            return None
        box = boxes.get(name)
        p = m.tensors.get(t.param) if t.param is not None else None
        if box is None and p is not None and p.shape == t.shape:
            box = boxes.get(t.param)  # type: ignore[arg-type]
        if box is None or len(box.offsets) != len(t.shape):
            box = Box((0,) * len(t.shape), tuple(t.shape))
        writers |= spec.ranks_for(t.shape, box)
    return {e.path for e in m.v2.sealed_files()} | {n for n, f in m.files.items() if f.rank in writers}


def fetch(
    coll: Any, nodes: NodeMap, root: Path, cand: Candidate, boxes: dict[str, Box] | None = None
) -> list[str]:
    """This rank's part of ``cand``'s transfers (module docstring, 3); returns its problems.  Collective.
    ``boxes``: this rank's live boxes; a node then receives only the files its ranks read (:func:`wanted`)."""
    assert cand.raw is not None
    m = Manifest.from_json(cand.raw, f"{step_dir(cand.step)}/{MANIFEST_NAME}")
    mine = wanted(m, boxes)
    needs: dict[int, set[str] | None] = {}
    for rank, want in enumerate(coll.all_gather(sorted(mine) if mine is not None else None)):
        node = nodes.node_of(rank)
        if want is None or needs.get(node, set()) is None:
            needs[node] = None
        else:
            needs[node] = needs.get(node, set()) | set(want)  # type: ignore[operator]
    transfers = [
        t
        for t in cand.transfers
        if needs.get(nodes.node_of(t[1])) is None or t[2] in needs[nodes.node_of(t[1])]
    ]  # type: ignore[operator]
    cand = Candidate(cand.step, cand.tier, cand.raw, transfers, cand.tiers, cand.note, cand.checked)
    final = root / step_dir(cand.step)
    leader = nodes.rank == nodes.leader(nodes.node)
    problems: list[str] = []
    try:
        if leader and final.exists():
            try:
                same = (final / MANIFEST_NAME).read_bytes() == cand.raw
            except OSError:
                same = False
            if not same and step_run_id(final) == m.run_id:
                drop(
                    final
                )  # another save of this step (a timeline a restore abandoned): never mixed with this
            elif not same:
                problems.append(f"{final} holds a step of another run (never replaced by this run)")
    except Exception as e:  # noqa: BLE001 - a problem of this rank's, told to every rank below
        problems.append(f"rank {nodes.rank}: {type(e).__name__}: {e}")
    # also: every node's leader is done with the check above
    token, problems = (
        coll.broadcast(uuid.uuid4().hex[:8]),
        [p for ps in coll.all_gather(problems) for p in ps],
    )
    if problems:
        return problems
    target = final if final.exists() else root / FETCH / f"{step_dir(cand.step)}-{token}"
    storage = open_storage(str(target))
    try:
        if leader and not (final / MANIFEST_NAME).exists():
            storage.put_bytes(MANIFEST_NAME, cand.raw, exclusive=False)
    except Exception as e:  # noqa: BLE001 - the receivers refuse what they cannot check; told to every rank
        problems.append(f"rank {nodes.rank}: {type(e).__name__}: {e}")
    sends = [Send(n, final / n, file_size(m, n), dst) for src, dst, n in cand.transfers if src == nodes.rank]
    recvs = [
        Receive(n, target / n, file_size(m, n), src) for src, dst, n in cand.transfers if dst == nodes.rank
    ]
    try:
        got = transfer(coll, sends, recvs)
        problems += got.problems + check_files(storage, m, got.kept)
    except Exception as e:  # noqa: BLE001 - told to every rank below
        problems.append(f"rank {nodes.rank}: {type(e).__name__}: {e}")
    problems = [p for ps in coll.all_gather(problems) for p in ps]
    renamed = None
    try:
        if not problems and target != final and leader:
            os.rename(target, final)
    except OSError as e:
        renamed = f"rank {nodes.rank}: cannot commit {final}: {e}"
    return [p for p in coll.all_gather(renamed) if p is not None]
