"""Placement of replicas over nodes and the restore plan, on N nodes (the gloo tests run 2): properties of
``NodeMap`` and ``agree.plan`` over synthetic inventories of a real step's manifest."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.format.manifest import MANIFEST_NAME, SEAL_RE, Manifest
from ckpt.tiers import agree
from ckpt.tiers.files import all_files, rank_files
from ckpt.tiers.node import NodeMap


def node_map(n_nodes: int, per_node: int, rank: int = 0) -> NodeMap:
    nodes = tuple(tuple(range(i * per_node, (i + 1) * per_node)) for i in range(n_nodes))
    return NodeMap(rank, nodes, "test")


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 7), st.integers(1, 4), st.data())
def test_replicas_land_on_distinct_other_nodes_and_sources_invert_peers(
    n: int, per: int, data: st.DataObject
) -> None:
    nodes = node_map(n, per)
    replicas = data.draw(st.integers(1, n - 1))
    nodes.check_replicas(replicas)
    for rank in range(n * per):
        homes = [nodes.node_of(nodes.peer(rank, k)) for k in range(1, replicas + 1)]
        # every copy on another node, no two on the same one: any `replicas` lost nodes leave one copy
        assert len(set(homes + [nodes.node_of(rank)])) == replicas + 1
        for k in range(1, replicas + 1):
            peer = nodes.peer(rank, k)
            assert nodes.source_of(peer, k) == rank
            assert nodes.nodes[nodes.node_of(peer)].index(peer) == nodes.nodes[nodes.node_of(rank)].index(
                rank
            )


def test_unequal_nodes_or_too_few_are_refused() -> None:
    import pytest

    with pytest.raises(ckpt.CkptError, match="replicas=2 needs at least 3 nodes; this job has 2"):
        node_map(2, 2).check_replicas(2)
    uneven = NodeMap(0, ((0, 1), (2,)), "GROUP_RANK")
    with pytest.raises(
        ckpt.CkptError, match=r"same number of ranks on every node; nodes have \[2, 1\] ranks"
    ):
        uneven.check_replicas(1)


def six_rank_manifest(tmp: Path) -> bytes:
    """A real manifest of a save by 6 writers (ckpt.publish of a 6-rank step made in one process)."""
    from ckpt.format.index import encode

    torch.manual_seed(0)
    model = torch.nn.Linear(12, 6)
    ckpt.save(str(tmp / "one"), step=3, model=model)
    m = ckpt.open_checkpoint(str(tmp / "one")).manifest
    # re-attribute the single writer's chunks to 6 ranks by tensor: enough to give every rank its own files
    import dataclasses

    files = {}
    tensors = {}
    for i, (name, e) in enumerate(m.tensors.items()):
        shards = []
        for s in e.shards:
            f = f"r{i:05d}-abcdef01.safetensors"
            files[f] = dataclasses.replace(m.files[s.file], path=f, rank=i)
            shards.append(dataclasses.replace(s, file=f))
        tensors[name] = dataclasses.replace(e, shards=tuple(shards))
    m6 = dataclasses.replace(m, files=files, tensors=tensors, rng={}, data={})
    top, _ = encode(m6, "abcdef01")
    return top.encode()


def test_the_plan_fetches_what_each_node_lacks_from_a_holder(tmp_path: Path) -> None:
    raw = six_rank_manifest(tmp_path)
    m = Manifest.from_json(raw, MANIFEST_NAME)
    seal = SEAL_RE.match(raw).group(1)  # type: ignore[union-attr]
    nodes = node_map(3, 2)  # ranks 0-1 node 0, 2-3 node 1, 4-5 node 2; the writers are ranks 0 and 1 only
    writers = sorted({f.rank for f in m.files.values()})
    files = all_files(m)
    assert writers and len(files) >= 2 * len(writers)

    def report(node: int, held: list[str]) -> dict:
        return {3: {"seal": seal, "held": held, "bad": [], "raw": raw}}

    # node 0 holds everything, node 1 nothing (replaced), node 2 all but the first writer's files
    first = rank_files(m, writers[0])
    reports = [report(0, files), {}, {}, {}, report(2, [f for f in files if f not in first]), {}]
    reports[1] = {3: {"seal": seal, "held": [], "bad": []}}
    (cand, persistent) = agree.plan(nodes, reports, [2])
    assert (cand.step, cand.tier, persistent.step, persistent.tier) == (3, "local", 2, "persistent")
    got: dict[int, set[str]] = {0: set(files), 1: set(), 2: {f for f in files if f not in first}}
    for src, dst, name in cand.transfers:
        assert name in got[nodes.node_of(src)], "a transfer's source holds the file"
        got[nodes.node_of(dst)].add(name)
    assert all(g == set(files) for g in got.values())  # every node ends with the whole step
    assert cand.tiers[:2] == ["local", "local"]


def test_a_file_held_nowhere_makes_the_step_unrestorable_and_older_ones_follow(tmp_path: Path) -> None:
    raw = six_rank_manifest(tmp_path)
    m = Manifest.from_json(raw, MANIFEST_NAME)
    seal = SEAL_RE.match(raw).group(1)  # type: ignore[union-attr]
    files = all_files(m)
    lost = files[-1]
    nodes = node_map(2, 1)
    reports = [
        {3: {"seal": seal, "held": files[:-1], "bad": [f"{lost}: checksum mismatch"], "raw": raw}},
        {3: {"seal": seal, "held": [], "bad": []}},
    ]
    skipped, older = agree.plan(nodes, reports, [1])
    assert (
        skipped.tier == ""
        and f"no node holds an intact {lost}" in skipped.note
        and "checksum mismatch" in skipped.note
    )
    assert (older.step, older.tier) == (1, "persistent")


def test_two_saves_of_one_step_on_different_nodes_are_never_mixed(tmp_path: Path) -> None:
    """A commit cut short after a restore abandoned a timeline: node 0 still holds the old save of step 3, node 1
    the new one.  The newer save is chosen, and node 0 gets all of its files (none of the old one's count)."""
    import json

    from ckpt.format.schema import seal

    old = six_rank_manifest(tmp_path)
    doc = json.loads(old)
    doc.pop("checksum")
    doc["created_at"] = "2099-01-01T00:00:00+00:00"
    new = seal(doc).encode()
    m = Manifest.from_json(new, MANIFEST_NAME)
    files = all_files(m)
    seal_of = {r: SEAL_RE.match(r).group(1) for r in (old, new)}  # type: ignore[union-attr]
    nodes = node_map(2, 1)
    reports = [
        {3: {"seal": seal_of[old], "held": files, "bad": [], "raw": old}},
        {3: {"seal": seal_of[new], "held": files, "bad": [], "raw": new}},
    ]
    (cand,) = agree.plan(nodes, reports, [])
    assert cand.raw == new
    assert sorted(name for _, dst, name in cand.transfers if dst == 0) == sorted(files)
    assert cand.tiers == ["peer", "local"]
