"""Step 2 of a save (collective): this rank's pieces, who writes each, and the replica check before writing.

:func:`ckpt.saving.planning.plan_local` / :func:`~ckpt.saving.planning.assign_writers` compute the assignment;
:class:`WriterPlanner` runs them across the ranks and keeps what the next save can reuse (the exact path's
gathered pieces while they do not change).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..distributed import Collective
from ..errors import CkptError
from ..format.dtypes import dtype_name
from ..format.manifest import Box, TensorDesc
from ..state.training import NamedTensor, is_dtensor, local_box
from .planning import (
    Group,
    HeldBox,
    assign_writers,
    chunk_boxes,
    digest,
    dtensor_group,
    plan_check,
    plan_local,
    world_group,
)
from .replicated import check_replica_groups, check_replicas, replicated_keys

# A layout hook: given a named tensor, return (global shape, local box, local tensor, partition metadata) when the
# tensor is a shard of a bigger logical tensor that plain torch cannot describe (NxD TP shards), else None.
LayoutHook = Callable[
    [NamedTensor], "tuple[tuple[int, ...], Box, torch.Tensor, dict[str, Any] | None] | None"
]

Local = dict[tuple[str, Box], torch.Tensor]


class WriterPlanner:
    """Agrees with the other ranks on the writer of every piece (:mod:`ckpt.saving.planning`).  One per
    checkpointer: the exact path's assignment is reused while no rank's pieces change."""

    def __init__(self, coll: Collective) -> None:
        self.coll = coll
        self._plan_key: list[str] | None = None
        self._plan: dict[tuple[str, Box], int] | None = None
        self._per_rank: list[list[HeldBox]] | None = None  # the exact path's gathered pieces
        self.last_plan = ""  # "local" or "exact": how the last save agreed on its writers (tests, benches)

    def describe(
        self, named: list[NamedTensor], layout_hook: LayoutHook | None
    ) -> tuple[list[HeldBox], Local, list[Group | None]]:
        """This rank's pieces, their local tensors, and the replica group of each where it can be derived."""
        pieces: list[HeldBox] = []
        local: Local = {}
        groups: list[Group | None] = []
        seen: set[str] = set()
        group_of = getattr(layout_hook, "replica_group", None)
        for nt in named:
            if nt.name in seen:
                raise CkptError(f"tensor name {nt.name!r} appears twice in the saved state")
            seen.add(nt.name)
            hooked = layout_hook(nt) if layout_hook is not None else None
            if hooked is not None:
                shape, box, t, partition = hooked
            else:
                shape, box, t = local_box(nt.tensor)
                partition = None
            group: Group | None
            if group_of is not None:  # the layout hook knows the parallel state
                group = group_of(nt, partition)
            elif is_dtensor(nt.tensor):
                group = dtensor_group(nt.tensor)
            elif hooked is None:
                group = world_group(self.coll.rank, self.coll.world_size)
            else:
                group = None
            p = HeldBox(
                TensorDesc(nt.name, nt.role, shape, dtype_name(t.dtype), nt.param, nt.key, partition), box
            )
            pieces.append(p)
            local[(p.name, p.box)] = t
            groups.append(group)
        return pieces, local, groups

    def assign(self, pieces: list[HeldBox], groups: list[Group | None]) -> list[bool]:
        """Which of this rank's pieces it writes (ckpt.saving.checkpointer's docstring, step 2).  Collective."""
        if not self.coll.active:
            self.last_plan = "local"
            return [True] * len(pieces)
        known = all(g is not None for g in groups)
        write, (a, b) = plan_local(pieces, groups) if known else ([], (0, 0))  # type: ignore[arg-type]
        a_tot, b_tot, unknown = self.coll.all_reduce_sum([a, b, 0 if known else 1])
        if not unknown and plan_check((a_tot, b_tot)):
            self.last_plan = "local"
            return write
        self.last_plan = "exact"
        key = self.coll.all_gather(digest(pieces))
        if key != self._plan_key or self._plan is None:
            self._per_rank = self.coll.all_gather(pieces)
            self._plan = assign_writers(self._per_rank)
            self._plan_key = key
        return [self._plan[(p.name, p.box)] == self.coll.rank for p in pieces]

    def check_replicas(self, pieces: list[HeldBox], groups: list[Group | None], local: Local) -> None:
        """Compare the copies of replicated pieces across ranks (:mod:`ckpt.saving.replicated`).  Collective;
        call after :meth:`assign`, whose path says how the replicas are known."""
        if self.last_plan == "exact":
            assert self._per_rank is not None
            check_replicas(self.coll, replicated_keys(self._per_rank), local)
        else:  # the local plan's groups say which pieces have replicas, and with whom
            held = [(p, g) for p, g in zip(pieces, groups, strict=True) if g is not None and g.size > 1]
            check_replica_groups(self.coll, held, local)


def chunks_of(
    mine: list[tuple[HeldBox, torch.Tensor]], chunk_bytes: int
) -> list[tuple[str, Box, torch.Tensor]]:
    """The pieces this rank writes cut into chunks of at most ``chunk_bytes`` along dim 0 (views, no copies)."""
    chunks: list[tuple[str, Box, torch.Tensor]] = []
    for p, t in mine:
        for b in chunk_boxes(p.box, p.itemsize, chunk_bytes):
            sub = t[b.relative_to(p.box)[0]] if b != p.box else t
            chunks.append((p.name, b, sub))
    return chunks


__all__ = ["LayoutHook", "Local", "WriterPlanner", "chunks_of"]
