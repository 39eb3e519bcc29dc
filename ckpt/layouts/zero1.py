"""The ZeRO-1 sharding rule (torch_xla ``ZeroRedundancyOptimizer``, NxD ``NeuronZero1Optimizer``): the one owner.

Each parameter's optimizer state is sharded on its own (no flat buffer across parameters): dim 0 of the TP-local
tensor is zero-padded up to a multiple of the DP size, then DP rank ``d`` keeps ``chunk(dp)[d]``.  0-dim entries
(Adam's ``step``) are kept whole on every DP rank.  The NxD file format around it (pids, ``shape_info``,
``sharded_master_weights``) is :mod:`ckpt.converters.nxd.zero1`'s business; the live optimizer capture is
:mod:`ckpt.neuron.zero1`'s.  Both call these functions, so the rule has one definition.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ckpt.errors import CkptError, LayoutError

#: an allocator ``(shape, dtype) -> uninitialised tensor``
Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def padded_dim0(rows: int, dp: int) -> int:
    """Dim 0 after padding ``rows`` to a multiple of ``dp``."""
    return -(-rows // dp) * dp


def shard_rows(rows: int, dp: int, dp_rank: int) -> tuple[int, int, int]:
    """``(start, valid, chunk)``: DP rank ``dp_rank`` holds ``chunk`` rows starting at unpadded row ``start``, of
    which the first ``valid`` are real (fewer, or none, where the padding falls on this rank)."""
    chunk = padded_dim0(rows, dp) // dp
    start = dp_rank * chunk
    return start, max(0, min(chunk, rows - start)), chunk


def shard(tensor: torch.Tensor, dp: int, dp_rank: int, empty: Empty | None = None) -> torch.Tensor:
    """DP rank ``dp_rank``'s shard of a TP-local tensor (a new tensor; 0-dim tensors are returned whole).

    ``empty(shape, dtype)``: allocate the shard there (e.g. file-backed memory) and copy its rows in; same values.
    """
    if tensor.dim() == 0:
        return tensor.clone()
    if empty is not None:
        start, valid, chunk = shard_rows(tensor.shape[0], dp, dp_rank)
        out = empty((chunk, *tensor.shape[1:]), tensor.dtype)
        out[:valid].copy_(tensor[start : start + valid])
        out[valid:].zero_()
        return out
    pad = padded_dim0(tensor.shape[0], dp) - tensor.shape[0]
    if pad:
        tensor = F.pad(tensor, [0, 0] * (tensor.dim() - 1) + [0, pad])
    return tensor.chunk(dp)[dp_rank].clone()


def shard_all(tensor: torch.Tensor, dp: int, empty: Empty | None = None) -> list[torch.Tensor]:
    """Every DP rank's shard of ``tensor`` (index = DP rank; ``empty``: see :func:`shard`)."""
    if tensor.dim() == 0:
        raise LayoutError("ZeRO-1 cannot shard a 0-dim tensor (torch_xla pads dim 0)")
    return [shard(tensor, dp, d, empty) for d in range(dp)]


def unshard(
    shards: Sequence[torch.Tensor],
    shape: Sequence[int],
    *,
    where: str = "",
    error: type[CkptError] = LayoutError,
) -> torch.Tensor:
    """Inverse of :func:`shard_all`: concatenate the DP shards along dim 0 and drop the padding rows.

    ``shape`` is the unpadded TP-local shape (NxD's ``shape_info``); shards that cannot make it (a different DP
    size, another parameter's shard) raise ``error`` naming ``where`` (readers of damaged files pass
    :class:`~ckpt.errors.CorruptionError`).
    """
    shape = tuple(int(s) for s in shape)
    dp = len(shards)
    first = shards[0]
    if first.dim() == 0:
        return first.clone()
    ok = (
        len(shape) == first.dim()
        and all(tuple(s.shape) == tuple(first.shape) for s in shards)
        and tuple(first.shape[1:]) == shape[1:]
        and first.shape[0] * dp == padded_dim0(shape[0], dp)
    )
    if not ok:
        got = [list(s.shape) for s in shards]
        raise error(f"{where + ': ' if where else ''}ZeRO-1 shards {got} do not make shape {list(shape)}")
    full = torch.cat(list(shards), dim=0) if dp > 1 else first
    return full[: shape[0]].clone() if full.shape[0] != shape[0] or dp == 1 else full


__all__ = ["padded_dim0", "shard", "shard_all", "shard_rows", "unshard"]
