"""Execute plans on tensors: one target tensor at a time, reading only the slices it needs.

``execute`` takes a *reader* (``Piece -> Tensor``) so the caller decides where bytes come from: an
in-memory dict here, ``safetensors`` ``get_slice`` or an NxD rank file in a streaming converter.  Results
are always fresh tensors (``torch.cat`` copies), never views that would keep a whole source alive or be
saved with its full storage by ``torch.save``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ckpt.errors import LayoutError
from ckpt.layouts.names import hf_to_nxd_name
from ckpt.layouts.plan import (
    Piece,
    Rank,
    TensorMeta,
    TensorPlan,
    full_meta_from_local,
    metas_of,
    plan_full_to_nxd,
    plan_nxd_to_full,
    plan_tensor_nxd_to_full,
)
from ckpt.layouts.spec import LayoutSpec

Reader = Callable[[Piece], torch.Tensor]


def slice_piece(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The part of ``tensor`` that ``piece`` names (a view)."""
    if piece.dim is None:
        return tensor
    return tensor.narrow(piece.dim, piece.start, piece.length)


def full_reader(state: Mapping[str, torch.Tensor]) -> Reader:
    """Reader over a full (HF-named) state dict."""
    return lambda piece: slice_piece(state[piece.name], piece)


def shards_reader(shards: Mapping[Rank, Mapping[str, torch.Tensor]]) -> Reader:
    """Reader over ``{(tp, pp): {nxd_name: tensor}}``."""

    def read(piece: Piece) -> torch.Tensor:
        assert piece.rank is not None
        return slice_piece(shards[piece.rank][piece.name], piece)

    return read


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs compare equal to themselves, -0.0 differs from 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _assemble(plan: TensorPlan, pieces: tuple[Piece, ...], read: Reader) -> torch.Tensor:
    parts = [read(p) for p in pieces]
    if plan.dim is None:
        out = parts[0].clone()
    else:
        out = torch.cat(parts, dim=plan.dim)
    if tuple(out.shape) != plan.meta.shape or out.dtype != plan.meta.dtype:
        raise LayoutError(
            f"{plan.name}: assembled {list(out.shape)} {out.dtype}, plan expects {list(plan.meta.shape)} {plan.meta.dtype}"
        )
    return out


def execute(plan: TensorPlan, read: Reader, *, verify_replicas: bool = False) -> torch.Tensor:
    """Build ``plan``'s tensor.  With ``verify_replicas``, every other stored copy (KV replicas, TP-replicated
    norms) must be bit-identical to the canonical one; a difference usually means a wrong ``--hw`` or
    ``--kv-size-multiplier``, or KV tiled by NxD's trn2 converter (which uses ``repeat``)."""
    out = _assemble(plan, plan.pieces, read)
    if verify_replicas:
        for replica in plan.replicas:
            if not bit_equal(out, _assemble(plan, replica, read)):
                where = sorted({p.rank for p in replica if p.rank is not None})
                raise LayoutError(
                    f"{plan.name}: the copy stored on (tp, pp) {where} differs from the canonical copy; "
                    "check --hw and --kv-size-multiplier"
                )
    return out


# ------------------------------------------------------------------------------------- convenience helpers


def full_to_rank_shards(
    tensors: Mapping[str, torch.Tensor], spec: LayoutSpec
) -> dict[Rank, dict[str, torch.Tensor]]:
    """NxD rank tensors made from the full tensors ``tensors``.

    ``tensors`` must hold whole fusion groups (see ``names.fusion_group``): one unfused tensor, or e.g.
    ``gate_proj`` and ``up_proj`` of one layer together.  Returns ``{(tp, pp): {nxd_name: tensor}}``.
    """
    plan = plan_full_to_nxd(spec, metas_of(tensors.items()))
    read = full_reader(tensors)
    out: dict[Rank, dict[str, torch.Tensor]] = {}
    for t in plan.tensors:
        assert t.rank is not None
        out.setdefault(t.rank, {})[t.name] = execute(t, read)
    return out


def rank_shards_to_full(
    name: str,
    shards: Mapping[Rank, Mapping[str, torch.Tensor]],
    spec: LayoutSpec,
    *,
    verify_replicas: bool = False,
) -> torch.Tensor:
    """Full HF tensor ``name`` from NxD rank tensors ``{(tp, pp): {nxd_name: tensor}}``."""
    nxd_name = hf_to_nxd_name(name, spec)
    local = next((s[nxd_name] for s in shards.values() if nxd_name in s), None)
    if local is None:
        raise LayoutError(f"{name} (stored as {nxd_name}) is on no rank")
    plan = plan_tensor_nxd_to_full(spec, name, full_meta_from_local(spec, name, TensorMeta.of(local)))
    return execute(plan, shards_reader(shards), verify_replicas=verify_replicas)


def full_state_to_nxd(
    state: Mapping[str, torch.Tensor], spec: LayoutSpec
) -> dict[Rank, dict[str, torch.Tensor]]:
    """Whole full state dict -> ``{(tp, pp): {nxd_name: tensor}}`` (in memory; for tests and small models)."""
    return full_to_rank_shards(state, spec)


def nxd_to_full_state(
    shards: Mapping[Rank, Mapping[str, torch.Tensor]], spec: LayoutSpec, *, verify_replicas: bool = False
) -> dict[str, torch.Tensor]:
    """Whole NxD layout -> full HF-named state dict; checks every rank holds what ``spec`` implies."""
    plan = plan_nxd_to_full(spec, {rank: metas_of(sd.items()) for rank, sd in shards.items()})
    read = shards_reader(shards)
    return {t.name: execute(t, read, verify_replicas=verify_replicas) for t in plan.tensors}
