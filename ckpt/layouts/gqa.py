"""Which query and KV heads each TP rank holds, in stored order, for NxD's GQA attention.

NxD replicates every KV head ``kv_size_multiplier`` (``m``) times so that ``kv_heads * m`` KV *slots* can
be split over TP ranks; rank ``r`` holds slots ``[r*L, (r+1)*L)`` with ``L = kv_heads*m/tp``.  Inside a rank
the model does plain HF GQA: local query head ``a`` attends with local KV slot ``a // (Lq/L)``
(``repeat_kv``), ``Lq = heads/tp``.  So the layout is correct iff the query heads stored next to a slot are
query heads of that slot's KV head.  Facts from NxD 0.18 (``qkv_linear.py`` ``_initialize_affine_weight``
and ``parallel_state.arrange_kv_groups``):

* trn1: KV is tiled, ``W.repeat(m)`` -> slots ``(K0..K{kv-1})(K0..K{kv-1})...``; slot ``t`` is KV head
  ``t % kv``, copy ``t // kv``.  KV-sharing groups are ranks ``j, j + tp/m, ...``.
* trn2: KV is interleaved, ``repeat_interleave(m)`` -> ``(K0 K0 ..)(K1 K1 ..)``; slot ``t`` is KV head
  ``t // m``, copy ``t % m``.  KV-sharing groups are adjacent ranks.

Copy ``c`` of KV head ``j`` is paired with the ``c``-th of ``m`` equal blocks of ``j``'s query heads
``[j*g, (j+1)*g)``, ``g = heads/kv_heads``.  This reproduces NxD's converter wherever it is correct
(trn1 interleaved Q order; trn2 contiguous Q order) and fixes its trn2 bug (it tiles KV with ``repeat``).
"""

from __future__ import annotations

from ckpt.layouts.spec import LayoutSpec


def slot_head(spec: LayoutSpec, slot: int) -> tuple[int, int]:
    """``(kv_head, copy)`` stored in global KV slot ``slot``."""
    kv, mult = spec.model.kv_heads, spec.kv_size_multiplier
    if spec.hw == "trn2":
        return slot // mult, slot % mult
    return slot % kv, slot // kv


def kv_slots_of_rank(spec: LayoutSpec, tp_rank: int) -> tuple[tuple[int, int], ...]:
    """``(kv_head, copy)`` for each local KV slot of ``tp_rank``, in stored order."""
    per_rank = spec.kv_slots // spec.tp
    return tuple(slot_head(spec, s) for s in range(tp_rank * per_rank, (tp_rank + 1) * per_rank))


def q_heads_of_slot(spec: LayoutSpec, kv_head: int, copy: int) -> range:
    """HF query heads paired with copy ``copy`` of ``kv_head``."""
    group = spec.model.heads // spec.model.kv_heads
    share = group // spec.kv_size_multiplier
    start = kv_head * group + copy * share
    return range(start, start + share)


def q_heads_of_rank(spec: LayoutSpec, tp_rank: int) -> tuple[int, ...]:
    """HF query heads held by ``tp_rank``, in stored order (o_proj columns follow the same order)."""
    return tuple(
        h for kv_head, copy in kv_slots_of_rank(spec, tp_rank) for h in q_heads_of_slot(spec, kv_head, copy)
    )


def kv_heads_of_rank(spec: LayoutSpec, tp_rank: int) -> tuple[int, ...]:
    """HF KV heads held by ``tp_rank``, in stored order."""
    return tuple(kv_head for kv_head, _ in kv_slots_of_rank(spec, tp_rank))


def kv_share_groups(spec: LayoutSpec) -> tuple[tuple[int, ...], ...]:
    """TP ranks holding identical KV slots (NxD all-reduces KV gradients within each group)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(spec.tp):
        groups.setdefault(kv_heads_of_rank(spec, r), []).append(r)
    return tuple(tuple(g) for g in groups.values())
