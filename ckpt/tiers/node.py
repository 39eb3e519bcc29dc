"""Which node each rank runs on, and which ranks hold a rank's replicas.

A node is identified by ``node_rank=`` when given, else torchrun's ``GROUP_RANK``, else the host name.  The ranks of
a node are ordered by global rank (their local rank: ``LOCAL_RANK`` when torchrun sets it); nodes are ordered by their
identity.  Replica ``k`` of a rank lives on the rank with the same local rank on the ``k``-th next node (cyclically),
so the loss of any ``replicas`` whole nodes leaves a copy of every rank's files.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from ..errors import CkptError


def node_identity(node_rank: int | None = None) -> tuple[str, Any]:
    """(where it came from, the identity) of this process's node."""
    if node_rank is not None:
        return "node_rank=", int(node_rank)
    env = os.environ.get("GROUP_RANK")
    if env is not None and env.strip().lstrip("-").isdigit():
        return "GROUP_RANK", int(env)
    return "host name", socket.gethostname()


@dataclass(frozen=True)
class NodeMap:
    """Every rank's node: ``nodes[i]`` lists the global ranks of node ``i`` in local-rank order."""

    rank: int
    nodes: tuple[tuple[int, ...], ...]
    source: str  # where the identities came from (messages)

    @classmethod
    def build(cls, coll: Any, node_rank: int | None = None) -> NodeMap:
        """Collective over ``coll`` (a :class:`ckpt.distributed.Collective`): every rank's identity gathered."""
        source, ident = node_identity(node_rank)
        local = os.environ.get("LOCAL_RANK")
        gathered = coll.all_gather((ident, int(local) if local and local.isdigit() else None))
        by_node: dict[Any, list[tuple[int, int]]] = {}
        for rank, (key, lr) in enumerate(gathered):
            by_node.setdefault(key, []).append((rank if lr is None else lr, rank))
        nodes = []
        for key in sorted(by_node, key=lambda k: (isinstance(k, str), k)):
            members = sorted(by_node[key])
            if len({lr for lr, _ in members}) != len(members):
                raise CkptError(f"node {key!r} ({source}): two ranks share a LOCAL_RANK ({members})")
            nodes.append(tuple(r for _, r in members))
        return cls(coll.rank, tuple(nodes), source)

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.nodes[self.node].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.nodes[self.node])

    def node_of(self, rank: int) -> int:
        for i, members in enumerate(self.nodes):
            if rank in members:
                return i
        raise CkptError(f"rank {rank} is on no node")

    def check_replicas(self, replicas: int) -> None:
        """Refuse a replica count the job's nodes cannot hold."""
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise CkptError(f"replicas={replicas!r}: expected a non-negative integer")
        if replicas == 0:
            return
        if replicas >= len(self.nodes):
            raise CkptError(
                f"replicas={replicas} needs at least {replicas + 1} nodes; this job has {len(self.nodes)} "
                f"(nodes told apart by {self.source}; pass node_rank= where several nodes share one host)"
            )
        sizes = {len(m) for m in self.nodes}
        if len(sizes) > 1:
            raise CkptError(
                f"replicas={replicas} needs the same number of ranks on every node; nodes have "
                f"{[len(m) for m in self.nodes]} ranks (by {self.source})"
            )

    def peer(self, rank: int, k: int) -> int:
        """The rank that holds replica ``k`` (>= 1) of ``rank``'s files: same local rank, ``k`` nodes on."""
        node = self.node_of(rank)
        target = self.nodes[(node + k) % len(self.nodes)]
        return target[self.nodes[node].index(rank)]

    def source_of(self, rank: int, k: int) -> int:
        """The rank whose replica ``k`` ``rank`` holds (the inverse of :meth:`peer`)."""
        node = self.node_of(rank)
        src = self.nodes[(node - k) % len(self.nodes)]
        return src[self.nodes[node].index(rank)]

    def leader(self, node: int) -> int:
        """The rank that does a node's folder work (commit renames, retention): its lowest local rank."""
        return self.nodes[node][0]
