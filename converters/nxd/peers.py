"""Every rank file of an NxD tag holds what its peers hold, checked before anything is planned.

TP peers of one PP stage hold the same tensor names, shapes and dtypes (their own slices of them); EP ranks hold
EP rank 0's tensors, the expert tensors being their own block of experts and everything else a copy.  A rank file
that differs is refused with the first tensor that differs, rather than converted into a wrong model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ckpt.errors import CorruptionError
from ckpt.safe_unpickle import TensorReference, load_torch_file

from .naming import RankKey
from .reader import NxdTagReader
from .xser import tensor_file

Metas = Sequence[tuple[str, tuple[int, ...], torch.dtype]]


def _first_difference(metas: Metas, reference: Metas) -> str:
    """The first (name, shape, dtype) of ``metas`` unlike ``reference``'s (the last one when one list is longer)."""
    odd = next((m for m, n in zip(metas, reference, strict=False) if m != n), (metas or reference)[-1])
    return f"{odd[0]} {list(odd[1])} {odd[2]}"


def check_tp_peers(per_rank: Mapping[tuple[int, int], Metas], where: str) -> None:
    """Every TP rank of a PP stage holds the tensors of TP rank 0 of that stage (``per_rank[(tp, pp)]``)."""
    for (t, p), metas in per_rank.items():
        if metas != per_rank[(0, p)]:
            raise CorruptionError(
                f"{where}: rank tp {t} pp {p} holds {_first_difference(metas, per_rank[(0, p)])}, unlike tp 0 of "
                f"its stage ({len(metas)} vs {len(per_rank[(0, p)])} tensors)"
            )


def check_ep_ranks(
    r: NxdTagReader, ep0: Mapping[tuple[int, int], Metas], ep: int, stacked: frozenset[str], where: str
) -> None:
    """Every EP rank holds the tensors of EP rank 0 (``ep0[(tp, pp)]``: same names, order, shapes, dtypes): the
    expert tensors (``stacked``) are its own block of experts, everything else a copy (compared bit for bit when
    read).  With xser, an EP rank's expert tensors must be in its own folder: NxD keeps only non-expert tensors once,
    under ``ep_rank_00``, so falling back there for an expert tensor would silently read another rank's experts."""
    for (t, p), metas in ep0.items():
        for k in range(1, ep):
            other = r.model_metas((t, p, k))
            if [(n, s, d) for n, s, d in other] != metas:
                raise CorruptionError(
                    f"{where}: rank tp {t} pp {p} ep {k} holds {_first_difference(other, metas)}, unlike ep 0 "
                    f"({len(other)} vs {len(metas)} tensors)"
                )
            if r.meta.xser:
                _check_own_expert_files(r.files.model[(t, p, k)], (t, p, k), stacked)
            if r.files.optim:  # a plain optimizer per EP rank: same parameters, groups and scalars
                mine, first = r.optimizer((t, p, k), lazy=True), r.optimizer((t, p, 0), lazy=True)
                if (mine is None) != (first is None) or (
                    mine is not None and first is not None and mine["param_groups"] != first["param_groups"]
                ):
                    raise CorruptionError(
                        f"{where}: optimizer of tp {t} pp {p} ep {k} has other param_groups than ep 0"
                    )


def _check_own_expert_files(path: Path, rank: RankKey, stacked: frozenset[str]) -> None:
    refs = load_torch_file(path)
    for name, ref in refs.items() if isinstance(refs, dict) else ():
        if name in stacked and isinstance(ref, TensorReference) and not tensor_file(path, ref.tid).is_file():
            raise CorruptionError(
                f"{tensor_file(path, ref.tid)}: expert tensor {name} of tp {rank[0]} pp {rank[1]} ep {rank[2]} is "
                "missing (an EP rank's experts are never shared with ep_rank_00)"
            )
