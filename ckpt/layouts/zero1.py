"""ZeRO-1 optimizer-state shards (NxD ``NeuronZero1Optimizer`` = torch_xla ``ZeroRedundancyOptimizer``).

Each parameter's state is sharded on its own (no flat buffer across parameters): dim 0 of the TP-local
tensor is zero-padded up to a multiple of ``dp``, then DP rank ``d`` keeps ``chunk(dp)[d]``.  The
unpadded TP-local shape is saved as ``shape_info[pid]``; 0-dim entries (``step``) are kept whole on every
DP rank.  ``sharded_master_weights`` (fp32 master copies, when saved) are sharded the same way; NxD's own
``nxd_convert_zero_checkpoints`` drops all but DP rank 0's shard of them, we do not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ckpt.errors import LayoutError


def padded_dim0(dim0: int, dp: int) -> int:
    """Dim 0 after padding to a multiple of ``dp``."""
    return -(-dim0 // dp) * dp


def shard_rows(dim0: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """``(start, real_rows)``: the unpadded rows of the full dim 0 that DP rank ``dp_rank`` holds
    (``real_rows`` may be smaller than the shard, or 0, when padding falls on this rank)."""
    size = padded_dim0(dim0, dp) // dp
    start = dp_rank * size
    return start, max(0, min(size, dim0 - start))


def shard(tensor: torch.Tensor, dp: int, dp_rank: int) -> torch.Tensor:
    """DP rank ``dp_rank``'s ZeRO-1 shard of a TP-local tensor (0-dim tensors are returned whole)."""
    if tensor.dim() == 0:
        return tensor.clone()
    pad = padded_dim0(tensor.shape[0], dp) - tensor.shape[0]
    if pad:
        tensor = F.pad(tensor, [0, 0] * (tensor.dim() - 1) + [0, pad])
    return tensor.chunk(dp)[dp_rank].clone()


def unshard(shards: Sequence[torch.Tensor], dim0: int) -> torch.Tensor:
    """Inverse of :func:`shard`: concatenate all DP ranks' shards and drop the padding rows."""
    if shards[0].dim() == 0:
        return shards[0].clone()
    sizes = {s.shape[0] for s in shards}
    if len(sizes) != 1 or padded_dim0(dim0, len(shards)) != sizes.pop() * len(shards):
        raise LayoutError(
            f"ZeRO-1 shards of sizes {[s.shape[0] for s in shards]} do not make dim 0 = {dim0} with --dp {len(shards)}"
        )
    return torch.cat(list(shards), dim=0)[:dim0].clone()


@dataclass(frozen=True)
class Zero1State:
    """Unsharded ZeRO-1 state of one (tp, pp) rank: ``{pid: {key: tensor}}`` and fp32 master weights."""

    base_state: dict[int, dict[str, torch.Tensor]]
    master_weights: dict[int, torch.Tensor]
    shape_info: dict[int, tuple[int, ...]]


def unshard_optimizer(dp_states: Sequence[Mapping[str, Any]]) -> Zero1State:
    """Merge the ZeRO-1 ``state_dict()``s of all DP ranks of one (tp, pp) rank (``dp_states[d]`` = rank d).

    Uses ``shape_info`` to drop padding and checks that every shard fits it; keys other than
    ``base_state``/``sharded_master_weights``/``shape_info`` (``param_groups``) are identical on all ranks
    and are the caller's business.
    """
    if not dp_states:
        raise LayoutError("no ZeRO-1 DP ranks given")
    shape_info = {int(pid): tuple(int(x) for x in shape) for pid, shape in dp_states[0]["shape_info"].items()}
    base: dict[int, dict[str, torch.Tensor]] = {}
    for pid, entry in dp_states[0]["base_state"].items():
        pid = int(pid)
        if pid not in shape_info:
            raise LayoutError(f"ZeRO-1 base_state has param {pid} but shape_info does not")
        merged = {}
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                merged[key] = value
                continue
            parts = [s["base_state"][pid][key] for s in dp_states]
            full = unshard(parts, shape_info[pid][0]) if value.dim() else value.clone()
            if value.dim() and tuple(full.shape) != shape_info[pid]:
                raise LayoutError(
                    f"ZeRO-1 param {pid} {key}: merged shape {list(full.shape)} != shape_info {list(shape_info[pid])}"
                )
            merged[key] = full
        base[pid] = merged
    master: dict[int, torch.Tensor] = {}
    if dp_states[0].get("sharded_master_weights") is not None:
        for pid in dp_states[0]["sharded_master_weights"]:
            parts = [s["sharded_master_weights"][pid] for s in dp_states]
            master[int(pid)] = unshard(parts, shape_info[int(pid)][0]).reshape(shape_info[int(pid)])
    return Zero1State(base, master, shape_info)


def shard_optimizer(state: Zero1State, dp: int, dp_rank: int) -> dict[str, Any]:
    """DP rank ``dp_rank``'s ``base_state``/``shape_info``/``sharded_master_weights`` entries of ``state``."""
    out: dict[str, Any] = {
        "base_state": {
            pid: {k: shard(v, dp, dp_rank) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            for pid, entry in state.base_state.items()
        },
        "shape_info": {pid: list(shape) for pid, shape in state.shape_info.items()},
    }
    if state.master_weights:
        out["sharded_master_weights"] = {
            pid: shard(t, dp, dp_rank) for pid, t in state.master_weights.items()
        }
    return out
