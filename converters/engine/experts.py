"""MoE experts in the streaming converter: NxD's stacked expert tensors seen as one 2-d tensor per expert.

NxD stores a layer's experts stacked and transposed (``gate_up_proj.weight`` ``[E, H, 2I]`` logically, TP-split on
dim 2; ``down_proj.weight`` ``[E, I, H]``, TP-split on dim 1; EP splits dim 0, which a Neuron manifest keeps inside
the logical tensor).  The layout engine plans expert ``j`` as ``<stacked name>#j`` (:mod:`ckpt.layouts.names`), laid
out like a dense ``gate_up_proj`` / ``down_proj``.  Here:

* :class:`ExpertViews` wraps a Neuron-layout source so it *describes* and *reads* those views: piece ``(X#j, rank,
  dim, start, length)`` is slot ``j`` of the rank's local ``X``, transposed, then sliced;
* :func:`stacked_parts` turns the per-rank plans of every view of one stacked tensor into the parts of that tensor
  for a Neuron target: one box ``[j, tp-block]`` per expert and TP rank, each made by its view's plan and delivered
  transposed (``TensorPlan.transpose``).

Optimizer state of an expert tensor (a moment shaped like it) gets the same views, named after the parameter's view
(``optim/<stacked>#j/<key>``), so moments follow their parameter through every plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from ckpt.errors import LayoutError
from ckpt.format.manifest import Box, TensorDesc
from ckpt.layouts import LayoutSpec, Piece, TensorPlan
from ckpt.layouts.names import EXPERT_STACKED, expert_view, nxd_to_hf_names
from ckpt.state.training import optim_name

from .source import MODEL_ROLES, Rank, Source, slice_of

#: stacked tensor's partition dim -> the dim of its per-expert (transposed) view
_VIEW_DIM = {2: 0, 1: 1}


class ExpertViews(Source):
    """A Neuron-layout source whose stacked expert tensors are presented as per-expert views (module docstring)."""

    def __init__(self, inner: Source, spec: LayoutSpec) -> None:
        self.inner = inner
        self.format = inner.format  # type: ignore[misc]
        self.path, self.layout, self.trees = inner.path, inner.layout, inner.trees
        self.config, self.flags, self.record = inner.config, inner.flags, inner.record
        self._spec = spec
        self._views: dict[str, tuple[str, int]] = {}
        self.tensors = {}
        for name, desc in inner.tensors.items():
            stacked = desc.param if desc.role == "optimizer_state" else name
            if stacked is None or not EXPERT_STACKED.match(stacked):
                self.tensors[name] = desc
                continue
            if len(desc.shape) != 3:
                raise LayoutError(
                    f"{self.path}: {name} has shape {list(desc.shape)}, expected [experts, rows, cols]"
                )
            part = desc.partition
            if part is not None and int(part["dim"]) not in _VIEW_DIM:
                raise LayoutError(
                    f"{self.path}: {name} is split on dim {part['dim']}; NxD splits experts on 1 or 2"
                )
            view_part = None
            if part is not None:
                view_part = {k: v for k, v in part.items() if k != "ep"} | {
                    "dim": _VIEW_DIM[int(part["dim"])]
                }
            experts, a, b = desc.shape
            for j in range(experts):
                if desc.role in MODEL_ROLES:
                    view = f"{name}#{j}"
                    self.tensors[view] = TensorDesc(view, desc.role, (b, a), desc.dtype, partition=view_part)
                else:  # a moment of the stacked tensor: the same view of it, named after the parameter's view
                    assert desc.key is not None
                    view = optim_name(f"{stacked}#{j}", desc.key)
                    self.tensors[view] = TensorDesc(
                        view, desc.role, (b, a), desc.dtype, f"{stacked}#{j}", desc.key, view_part
                    )
                self._views[view] = (name, j)

    def _inner_piece(self, piece: Piece) -> Piece | None:
        found = self._views.get(piece.name)
        if found is None:
            return None
        stacked, j = found
        return Piece(stacked, piece.rank, 0, j, 1)

    def read(self, piece: Piece) -> torch.Tensor:
        inner = self._inner_piece(piece)
        if inner is None:
            return self.inner.read(piece)
        return slice_of(self.inner.read(inner)[0].transpose(0, 1), piece)

    def locate(self, piece: Piece) -> Hashable:
        inner = self._inner_piece(piece)
        if inner is None:
            return self.inner.locate(piece)
        return ("expert view", self.inner.locate(inner), piece.dim, piece.start, piece.length)

    def pp_ranks(self, name: str) -> tuple[int, ...]:
        found = self._views.get(name)
        return self.inner.pp_ranks(found[0] if found else name)

    def spec(self, config: Mapping[str, Any] | None = None) -> LayoutSpec:
        return self.inner.spec(config) if config is not None else self._spec

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else a concrete source offers (zero1, ...)
        return getattr(self.inner, name)


def hf_names(name: str, spec: LayoutSpec) -> list[str]:
    """HF tensors stored in NxD tensor ``name``: every expert's parts for a stacked expert tensor (optimizer
    param_groups name the stacked tensor), else :func:`~ckpt.layouts.names.nxd_to_hf_names` of the family."""
    if spec.family.experts is not None and EXPERT_STACKED.match(name):
        return [h for j in range(spec.model.experts) for h in nxd_to_hf_names(f"{name}#{j}", spec.family)]
    return list(nxd_to_hf_names(name, spec.family))


def stacked_name(name: str) -> str:
    """The stacked tensor of an expert view name (``X#j`` -> ``X``); any other name as it is."""
    found = expert_view(name)
    return found[0] if found is not None else name


def with_expert_views(source: Source, spec: LayoutSpec) -> Source:
    """``source`` itself, or wrapped in :class:`ExpertViews` when it is a Neuron layout of an MoE family."""
    if source.layout != "neuron" or spec.family.experts is None or isinstance(source, ExpertViews):
        return source
    return ExpertViews(source, spec)


def stacked_parts(
    views: Mapping[int, Mapping[Rank, TensorPlan]], partition_dim: int, tp: int, pps: tuple[int, ...]
) -> tuple[tuple[int, ...], list[tuple[Box, TensorPlan, tuple[Rank, ...]]]]:
    """Logical shape of one stacked expert tensor and its parts ``(box, plan, ranks)`` from the per-rank plans of
    its views ``{expert: {(tp, pp): plan}}`` (plans of ``[rows, cols]`` views; boxes of the ``[E, cols, rows]``
    stacked tensor, one per expert and TP rank, the plan marked to deliver its result transposed)."""
    experts = sorted(views)
    if experts != list(range(len(experts))):
        raise LayoutError(f"experts {experts} do not number 0..{len(experts) - 1}")
    first = views[0][(0, pps[0])].meta.shape  # one rank's view [rows, cols]
    local = (1, first[1], first[0])  # one expert's slot of one rank
    shape = [len(experts), local[1], local[2]]
    shape[partition_dim] *= tp
    parts = []
    for j in experts:
        for t in range(tp):
            offs = [j, 0, 0]
            offs[partition_dim] = t * local[partition_dim]
            plan = dataclasses.replace(views[j][(t, pps[0])], transpose=True)
            parts.append((Box(tuple(offs), local), plan, tuple((t, p) for p in pps)))
    return tuple(shape), parts


__all__ = ["ExpertViews", "expert_view", "hf_names", "stacked_name", "stacked_parts", "with_expert_views"]
