"""Where each parameter lies in DeepSpeed's ZeRO partitions (stages 1, 2, 3), and the inverse (what DeepSpeed
writes), without DeepSpeed.

The facts (DeepSpeed's ``runtime/zero/stage_1_and_2.py``, ``stage3.py``, ``utils/zero_to_fp32.py``):

- **Stages 1 and 2**: per optimizer param group, the trainable parameters (in the order ``param_shapes[g]`` lists
  them: DeepSpeed's round-robin order when ``round_robin_gradients``) are flattened into one vector, each followed
  by ``param_alignment_paddings[g][i]`` zeros (the last by none), and the vector is padded to a multiple of
  ``2 * world`` and cut into ``world`` equal partitions of ``P`` elements.  Rank ``r`` saves its fp32 partition
  *without* the tail padding (``single_partition_of_fp32_groups``: ``clamp(total - r * P, 0, P)`` elements, where
  ``total`` is the unpadded vector's length), and its optimizer's moments for the group with it (``P`` elements:
  the padded partition).  The saved partitions, concatenated in rank order, are the vector.
- **Stage 3**: each parameter is cut into ``world`` pieces of ``ceil(numel / world)`` elements (the last ones
  zero-padded); rank ``r`` holds piece ``r`` of every parameter, concatenated in ``param_shapes`` order and split
  into sub-groups (``fp32_flat_groups``: a new sub-group after the one whose size reaches ``sub_group_size``).  The
  moments have the same layout.

A :class:`Slot` says which ``(rank, group, start, length)`` segments of those flat tensors make a parameter, so
one parameter is read at a time (the flat tensors are memory-mapped: nothing else is touched).  Every layout is
checked to use every saved element exactly (besides DeepSpeed's own padding): a folder whose shapes do not add up
to its partitions is refused, never guessed at.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ckpt.errors import LayoutError


@dataclass(frozen=True)
class Segment:
    """``length`` elements from ``start`` of flat tensor ``group`` of rank ``rank``."""

    rank: int
    group: int
    start: int
    length: int


@dataclass(frozen=True)
class Slot:
    """Where one parameter lies: its segments, in order, make its flattened elements."""

    name: str
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def zero12_slots(
    param_shapes: Sequence[Mapping[str, Sequence[int]]],
    saved: Sequence[Sequence[int]],
    partition_size: Sequence[int],
    paddings: Sequence[Sequence[int]] | None,
    where: str,
) -> dict[str, Slot]:
    """The slots of a stage-1/2 checkpoint.

    ``saved[r][g]``: elements of rank ``r``'s saved fp32 partition of group ``g``; ``partition_size[g]``: ``P``
    (the moments' length); ``paddings[g][i]``: alignment zeros after parameter ``i`` of group ``g`` (None: none)."""
    world = len(saved)
    if any(len(s) != len(param_shapes) for s in saved):
        raise LayoutError(f"{where}: the ranks save {[len(s) for s in saved]} fp32 groups; param_shapes has "
                          f"{len(param_shapes)}")  # fmt: skip
    slots: dict[str, Slot] = {}
    for g, shapes in enumerate(param_shapes):
        pads = list(paddings[g]) if paddings is not None else [0] * len(shapes)
        if len(pads) != len(shapes):
            raise LayoutError(f"{where}: group {g} has {len(shapes)} parameters and {len(pads)} alignment paddings")
        total = sum(int(saved[r][g]) for r in range(world))
        p = int(partition_size[g])
        for r in range(world):
            if int(saved[r][g]) != min(max(total - r * p, 0), p):
                raise LayoutError(
                    f"{where}: rank {r} saves {saved[r][g]} fp32 elements of group {g}; partitions of {p} over "
                    f"{world} ranks holding {total} need {min(max(total - r * p, 0), p)}"
                )
        if p * world != math.ceil(total / (2 * world)) * 2 * world:
            raise LayoutError(
                f"{where}: group {g}: {world} partitions of {p} are not {total} elements padded to a multiple of "
                f"{2 * world}"
            )
        offset = 0
        for (name, shape), pad in zip(shapes.items(), pads, strict=True):
            n = _numel(shape)
            segs = []
            for r in range(world):
                lo, hi = max(offset, r * p), min(offset + n, r * p + p)
                if lo < hi:
                    segs.append(Segment(r, g, lo - r * p, hi - lo))
            slots[name] = Slot(name, tuple(int(s) for s in shape), tuple(segs))
            offset += n + int(pad)
        if offset != total:
            raise LayoutError(
                f"{where}: group {g}'s parameters (param_shapes) hold {offset} elements with their alignment, its "
                f"saved fp32 partitions {total}"
            )
    return slots


def _locate(sizes: Sequence[int], start: int, length: int, rank: int) -> list[Segment]:
    """``[start, start + length)`` of one rank's sub-groups laid end to end, as segments of the sub-groups."""
    out = []
    base = 0
    for g, size in enumerate(sizes):
        lo, hi = max(start, base), min(start + length, base + size)
        if lo < hi:
            out.append(Segment(rank, g, lo - base, hi - lo))
        base += size
    return out


def zero3_slots(param_shapes: Mapping[str, Sequence[int]], sizes: Sequence[Sequence[int]], where: str) -> dict[str, Slot]:
    """The slots of a stage-3 checkpoint: ``sizes[r]``: the lengths of rank ``r``'s ``fp32_flat_groups``."""
    world = len(sizes)
    if any(list(s) != list(sizes[0]) for s in sizes):
        raise LayoutError(f"{where}: the ranks' fp32_flat_groups differ in size ({[list(s) for s in sizes]})")
    slots: dict[str, Slot] = {}
    offset = 0
    for name, shape in param_shapes.items():
        n = _numel(shape)
        piece = math.ceil(n / world)
        segs: list[Segment] = []
        for r in range(world):
            take = min(max(n - r * piece, 0), piece)
            if take:
                segs += _locate(sizes[r], offset, take, r)
        slots[name] = Slot(name, tuple(int(s) for s in shape), tuple(segs))
        offset += piece
    if offset != sum(int(s) for s in sizes[0]):
        raise LayoutError(
            f"{where}: the parameters (param_shapes) need {offset} elements per rank; each rank's fp32_flat_groups "
            f"hold {sum(int(s) for s in sizes[0])}"
        )
    return slots


def gather(slot: Slot, flat: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """The parameter ``slot`` names, from ``flat(rank, group)`` (a view when it lies in one segment)."""
    parts = [flat(s.rank, s.group).narrow(0, s.start, s.length) for s in slot.segments]
    whole = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.empty(0)
    return whole.view(slot.shape)


def partition_zero12(
    groups: Sequence[Sequence[torch.Tensor]], world: int, param_alignment: int = 1
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], list[list[int]]]:
    """What a stage-1/2 save holds for ``groups`` of parameters (fp32 or the moments alike): ``(saved[r][g],
    padded[r][g], paddings[g])`` (the partitions without and with the tail padding, and the alignment zeros after
    each parameter).  The inverse of :func:`zero12_slots` + :func:`gather`; the layout tests use it."""
    saved: list[list[torch.Tensor]] = [[] for _ in range(world)]
    padded: list[list[torch.Tensor]] = [[] for _ in range(world)]
    paddings = []
    for params in groups:
        pads, parts, offset = [], [], 0
        for i, t in enumerate(params):
            offset += t.numel()
            pad = 0 if i == len(params) - 1 else (-offset) % param_alignment
            offset += pad
            parts += [t.reshape(-1), t.new_zeros(pad)]
            pads.append(pad)
        flat = torch.cat(parts) if parts else torch.empty(0)
        total = flat.numel()
        align = 2 * world
        p = math.ceil(total / align) * align // world
        flat = torch.cat([flat, flat.new_zeros(p * world - total)])
        for r in range(world):
            part = flat[r * p : r * p + p]
            padded[r].append(part)
            saved[r].append(part[: min(max(total - r * p, 0), p)])
        paddings.append(pads)
    return saved, padded, paddings


def partition_zero3(params: Sequence[torch.Tensor], world: int, sub_group_size: int) -> list[list[torch.Tensor]]:
    """What a stage-3 save holds for ``params``: ``flat[r][sub_group]`` (the inverse of :func:`zero3_slots` +
    :func:`gather`)."""
    bounds, size = [], 0  # sub-groups: close one when its partition numel reaches sub_group_size
    for i, t in enumerate(params):
        size += math.ceil(t.numel() / world)
        if size >= sub_group_size or i == len(params) - 1:
            bounds.append(i + 1)
            size = 0
    out: list[list[torch.Tensor]] = [[] for _ in range(world)]
    lo = 0
    for hi in bounds:
        for r in range(world):
            pieces = []
            for t in params[lo:hi]:
                piece = math.ceil(t.numel() / world)
                flat = torch.cat([t.reshape(-1), t.new_zeros(piece * world - t.numel())])
                pieces.append(flat[r * piece : r * piece + piece])
            out[r].append(torch.cat(pieces))
        lo = hi
    return out


__all__ = ["Segment", "Slot", "gather", "partition_zero12", "partition_zero3", "zero12_slots", "zero3_slots"]
