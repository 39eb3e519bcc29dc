"""ZeRO-1 with expert parallelism: NxD's ``NeuronEPZero1Optimizer`` files, merged per (tp, pp, ep) rank and re-sharded.

Facts (NxD 2.29 ``optimizer/zero_redundancy_optimizer.py``, ``parallel_layers/parallel_state.py``,
``trainer/checkpoint.py``):

* the optimizer is two ZeRO-1 optimizers: the non-expert parameters sharded over the data-parallel group (size
  ``dp``), the expert parameters (``expert_model_parallel``: NxD's stacked ``expert_mlps`` tensors) over the *expert*
  data-parallel group (size ``dp / ep``).  With NxD's rank layout (``cluster_ranks_exp`` ``[pp, dp/ep, ep, tp]``, TP
  contiguous) DP rank ``d`` is EP rank ``d mod ep`` and expert-DP rank ``d div ep``.  A non-expert shard is padded
  to a multiple of ``dp`` and reduce-scattered first over the expert-DP group (chunk ``d div ep`` of ``dp/ep``), then
  over the EP group (chunk ``d mod ep`` of ``ep``; ``_get_sharding_schemes``): that is chunk ``d`` of ``dp``, the
  plain ZeRO-1 rule.  An expert shard is padded to a multiple of ``dp/ep`` and is chunk ``d div ep`` of ``dp/ep``;
* each DP rank saves one file, ``optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt`` (no ep field), holding
  ``state_dict()``: the non-expert optimizer's dict with the expert one's appended: ``param_groups`` = non-expert
  groups + expert groups (each the user's groups filtered, pids counted per optimizer), ``state`` / ``base_state`` /
  ``shape_info`` of the expert optimizer under keys shifted by ``ep_param_id_offset`` / ``ep_base_state_offset`` /
  ``ep_shape_info_offset`` (each ``max(key) + 1`` of the non-expert table, 1 when it is empty), and
  ``ep_param_group_offset`` = the number of non-expert groups.  Nothing else of the two dicts is kept (no
  ``sharded_master_weights``).

The named form (what :class:`~.reader.NxdTagReader` hands out per (tp, pp, ep) rank) joins group ``i`` of both
optimizers into one group (their hyper-parameters must agree: NxD syncs them), names in model order; the writer splits
it back by expert-ness, so the files come out as NxD writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckpt.errors import CorruptionError, LayoutError

from .zero1 import merge_zero1_optimizer, resolve_param_names, shard_zero1_optimizer

Shape = tuple[int, ...]
OFFSETS = ("ep_param_id_offset", "ep_param_group_offset", "ep_base_state_offset", "ep_shape_info_offset")


def is_ep_zero1_dict(obj: Any) -> bool:
    """True for a ``NeuronEPZero1Optimizer.state_dict()``."""
    return isinstance(obj, dict) and all(k in obj for k in OFFSETS)


def split(d: Mapping[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One DP rank's dict -> (non-expert ZeRO-1 dict, expert ZeRO-1 dict), as NxD's ``load_state_dict`` splits it."""
    extra = sorted(set(d) - {*OFFSETS, "state", "base_state", "shape_info", "param_groups"})
    if extra:
        raise CorruptionError(f"{where}: NeuronEPZero1Optimizer dict with unexpected key {extra[0]!r}")
    cut = int(d["ep_param_group_offset"])

    def tables(key: str, offset_key: str) -> tuple[dict[int, Any], dict[int, Any]]:
        off = int(d[offset_key])
        lo = {int(k): v for k, v in d[key].items() if int(k) < off}
        hi = {int(k) - off: v for k, v in d[key].items() if int(k) >= off}
        return lo, hi

    state = tables("state", "ep_param_id_offset")
    base = tables("base_state", "ep_base_state_offset")
    shapes = tables("shape_info", "ep_shape_info_offset")
    groups = (list(d["param_groups"][:cut]), list(d["param_groups"][cut:]))
    return tuple(  # type: ignore[return-value]
        {"state": state[i], "param_groups": groups[i], "base_state": base[i], "shape_info": shapes[i]}
        for i in range(2)
    )


def _join_groups(
    a: list[dict[str, Any]], b: list[dict[str, Any]], order: Sequence[str], where: str
) -> list[dict]:
    if len(a) != len(b):
        raise CorruptionError(f"{where}: {len(a)} non-expert param_groups but {len(b)} expert ones")
    pos = {n: i for i, n in enumerate(order)}
    out = []
    for i, (ga, gb) in enumerate(zip(a, b, strict=True)):
        ha = {k: v for k, v in ga.items() if k != "params"}
        hb = {k: v for k, v in gb.items() if k != "params"}
        if ha != hb:
            raise LayoutError(
                f"{where}: param group {i} has other hyper-parameters for expert than for non-expert parameters"
            )
        out.append({**ha, "params": sorted([*ga["params"], *gb["params"]], key=pos.__getitem__)})
    return out


def merge(
    dp_dicts: Sequence[Mapping[str, Any]],
    ep: int,
    ep_rank: int,
    model_shapes: Sequence[tuple[str, Shape]],
    is_expert: Callable[[str], bool],
    *,
    where: str,
    lazy: bool = False,
) -> dict[str, Any]:
    """The named optimizer of one (tp, pp, ``ep_rank``) rank from every DP rank's file of its (tp, pp) (index = DP
    rank): non-expert state merged over all ``dp`` files, expert state over the files of DP ranks
    ``e * ep + ep_rank``.  ``model_shapes``: that rank's model tensors (names give the pids, shapes check them)."""
    dp = len(dp_dicts)
    if dp % ep:
        raise CorruptionError(f"{where}: {dp} DP optimizer files do not split over ep {ep}")
    halves = [split(d, f"{where} (dp {i})") for i, d in enumerate(dp_dicts)]
    non_shapes = [(n, s) for n, s in model_shapes if not is_expert(n)]
    exp_shapes = [(n, s) for n, s in model_shapes if is_expert(n)]
    non0, exp0 = halves[0][0], halves[ep_rank][1]
    non_names = resolve_param_names(non_shapes, non0["param_groups"], non0["shape_info"], where=where)
    exp_names = resolve_param_names(exp_shapes, exp0["param_groups"], exp0["shape_info"], where=where)
    non = merge_zero1_optimizer([h[0] for h in halves], non_names, where=where, lazy=lazy)
    mine = [halves[d][1] for d in range(ep_rank, dp, ep)]
    exp = merge_zero1_optimizer(mine, exp_names, where=f"{where} (experts, ep {ep_rank})", lazy=lazy)
    order = [n for n, _ in model_shapes]
    return {
        "state": {n: v for part in (non["state"], exp["state"]) for n, v in part.items()},
        "param_groups": _join_groups(non["param_groups"], exp["param_groups"], order, where),
        "master_weights": None,
        "extra": {},
    }


def shard(
    named: Mapping[str, Any],
    param_shapes: Mapping[str, Shape],
    dp: int,
    ep: int,
    ep_rank: int,
    is_expert: Callable[[str], bool],
    *,
    where: str,
    empty: Any = None,
) -> dict[int, dict[str, Any]]:
    """Inverse of :func:`merge` for one (tp, pp, ``ep_rank``) rank: the file of every DP rank ``d`` with
    ``d mod ep == ep_rank`` (``{d: dict}``), as ``NeuronEPZero1Optimizer.state_dict()`` makes it."""
    if dp % ep:
        raise LayoutError(
            f"--dp {dp} is not a multiple of --ep {ep} (NxD's expert data parallel size is dp/ep)"
        )
    if named.get("master_weights"):
        raise LayoutError(
            f"{where}: NxD's NeuronEPZero1Optimizer does not save master weights; they cannot be written with --ep"
        )

    def part(expert: bool) -> dict[str, Any]:
        groups = [
            {**g, "params": [n for n in g["params"] if is_expert(n) == expert]} for g in named["param_groups"]
        ]
        state = {n: v for n, v in named["state"].items() if is_expert(n) == expert}
        return {"state": state, "param_groups": groups, "master_weights": None, "extra": {}}

    non = shard_zero1_optimizer(part(False), param_shapes, dp, where=where, empty=empty)
    exp = shard_zero1_optimizer(part(True), param_shapes, dp // ep, where=where, empty=empty)
    out = {}
    for d in range(ep_rank, dp, ep):
        a, b = non[d], exp[d // ep]

        def offset(table: Mapping[int, Any]) -> int:
            return max(table) + 1 if table else 1

        offs = {
            "ep_param_id_offset": offset(a["state"]),
            "ep_param_group_offset": len(a["param_groups"]),
            "ep_base_state_offset": offset(a["base_state"]),
            "ep_shape_info_offset": offset(a["shape_info"]),
        }
        out[d] = {
            **offs,
            "param_groups": a["param_groups"] + b["param_groups"],
            "state": {**a["state"], **{offs["ep_param_id_offset"] + k: v for k, v in b["state"].items()}},
            "base_state": {
                **a["base_state"],
                **{offs["ep_base_state_offset"] + k: v for k, v in b["base_state"].items()},
            },
            "shape_info": {
                **a["shape_info"],
                **{offs["ep_shape_info_offset"] + k: v for k, v in b["shape_info"].items()},
            },
        }
    return out


__all__ = ["OFFSETS", "is_ep_zero1_dict", "merge", "shard", "split"]
