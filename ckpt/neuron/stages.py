"""Pipeline stages: which tensors a PP stage holds, and one optimizer record for all stages.

Under PP each stage's model and optimizer hold only that stage's parameters, while a checkpoint holds them all.  The
manifest's ``optimizer`` record (param_groups by parameter name, scalar state such as AdamW's ``step``) is written once,
so the saver merges the stages' records; a restoring stage compares and fills only its own parameters, which
``extra.nxd.pp_ranks`` names.
"""

from __future__ import annotations

from typing import Any

from ckpt.errors import StateMismatchError

from .parallel import ParallelInfo


def stage_tensors(manifest: Any, parallel: ParallelInfo) -> set[str] | None:
    """Names of the tensors the PP stage of ``parallel`` holds; None without PP (or without recorded stages)."""
    pp_ranks = ((manifest.extra or {}).get("nxd") or {}).get("pp_ranks")
    if parallel.pp_size == 1 or not pp_ranks:
        return None
    return {n for n, ranks in pp_ranks.items() if parallel.pp_rank in ranks}


def merge_stage_optimizers(records: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """One ``optimizer`` record from every rank's ``(pp_rank, record)``: param_groups' parameter lists concatenated
    in stage order, scalar state united.  The stages must agree on everything else (class, group count and
    hyperparameters): they are one optimizer split by stage."""
    by_stage: dict[int, dict[str, Any]] = {}
    for pp, rec in records:
        by_stage.setdefault(pp, rec)
    stages = [by_stage[pp] for pp in sorted(by_stage)]
    first = stages[0]
    merged = {k: v for k, v in first.items() if k not in ("param_groups", "state")}
    groups = [dict(g, params=list(g["params"])) for g in first["param_groups"]]
    state = dict(first.get("state", {}))
    for pp, rec in zip(sorted(by_stage)[1:], stages[1:], strict=True):
        other = rec["param_groups"]
        same = len(other) == len(groups) and all(
            {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in o.items() if k != "params"}
            for g, o in zip(groups, other, strict=False)
        )
        if not same or {k: v for k, v in rec.items() if k not in ("param_groups", "state")} != merged:
            raise StateMismatchError(
                f"PP stage {pp}'s optimizer differs from stage 0's (class, param_groups or hyperparameters): the "
                "stages of one pipeline must share one optimizer configuration"
            )
        for g, o in zip(groups, other, strict=True):
            g["params"].extend(o["params"])
        state.update(rec.get("state", {}))
    merged["param_groups"] = groups
    merged["state"] = state
    return merged
