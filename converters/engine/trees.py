"""Everything of a checkpoint that is not a model or optimizer tensor, and how it is renamed between layouts.

The trees travel in manifest (encoded, :mod:`ckpt.format.treecodec`) form, so a conversion never decodes what it does not
need to change: optimizer ``param_groups`` and per-parameter scalar state are renamed with their tensors (NxD fuses
q/k/v and gate/up into one parameter, so a rename can merge or split entries), and the XLA RNG records, which only
torch_xla can restore, move to ``extra.neuron_rng`` on the CUDA side and back.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpt.errors import LayoutError
from ckpt.format.manifest import Manifest

#: rng record keys that only torch_xla can restore; kept as metadata (``extra.neuron_rng``) on the CUDA side.
XLA_RNG_KEYS = ("xla_seed", "xla_nxd_tracker")


@dataclass
class Trees:
    """Everything that is not a model/optimizer tensor, in manifest (encoded) form, so that it travels losslessly."""

    step: int = 0
    optimizer: dict[str, Any] | None = None
    scheduler: Any = None
    scaler: Any = None
    rng: dict[str, Any] = field(default_factory=dict)
    progress: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    data_position: dict[str, Any] | None = None
    rng_base: dict[str, Any] | None = None
    tokenizer: dict[str, Any] | None = None
    user: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1

    @classmethod
    def of_manifest(cls, m: Manifest) -> Trees:
        return cls(
            step=m.step,
            optimizer=copy.deepcopy(m.optimizer),
            scheduler=copy.deepcopy(m.scheduler),
            scaler=copy.deepcopy(m.scaler),
            rng=copy.deepcopy(m.rng),
            progress=copy.deepcopy(m.progress) or {"step": m.step},
            data=copy.deepcopy(m.data),
            data_position=copy.deepcopy(m.data_position),
            rng_base=copy.deepcopy(m.rng_base),
            tokenizer=copy.deepcopy(m.tokenizer),
            user=copy.deepcopy(m.user),
            extra=copy.deepcopy(m.extra),
            environment=copy.deepcopy(m.environment),
            world_size=m.layout.world_size,
        )

    def as_commit_trees(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "rng": self.rng,
            "progress": self.progress or {"step": self.step},
            "data": self.data,
            "data_position": self.data_position,
            "rng_base": self.rng_base,
            "tokenizer": self.tokenizer,
            "user": self.user,
            "extra": self.extra,
        }


def rename_optimizer(
    opt: dict[str, Any] | None, expand: Callable[[str], list[str]], merge_scalars: bool, where: str
) -> dict[str, Any] | None:
    """param_groups (names) and per-parameter scalar state renamed with ``expand`` (one name -> its new names).

    ``merge_scalars``: several old names may become one new name (fusing); their scalar state must then agree.
    """
    if opt is None:
        return None
    out = copy.deepcopy(opt)
    groups = []
    group_of: dict[str, int] = {}
    for gi, g in enumerate(opt.get("param_groups", [])):
        g2 = dict(g)
        g2["params"] = list(dict.fromkeys(n for p in g["params"] for n in expand(p)))
        for n in g2["params"]:
            if group_of.setdefault(n, gi) != gi:
                raise LayoutError(
                    f"{where}: parameters fused into {n} are in different param_groups ({group_of[n]} and {gi}); "
                    "NxD keeps a fused tensor in one group"
                )
        groups.append(g2)
    out["param_groups"] = groups
    state: dict[str, Any] = {}
    for p, per in opt.get("state", {}).items():
        for n in expand(p):
            if n in state and merge_scalars:
                if json.dumps(state[n], sort_keys=True) != json.dumps(per, sort_keys=True):
                    raise LayoutError(
                        f"{where}: parameters fused into {n} have different optimizer scalar state ({p})"
                    )
                continue
            state[n] = copy.deepcopy(per)
    out["state"] = state
    return out


def move_xla_rng_out(trees: Trees) -> None:
    """Move the XLA-only RNG records to ``extra.neuron_rng`` (a CUDA restore cannot use them; a way back can)."""
    neuron_rng: dict[str, Any] = {}
    for rank, rec in trees.rng.items():
        if isinstance(rec, dict):
            moved = {k: rec.pop(k) for k in XLA_RNG_KEYS if k in rec}
            if moved:
                neuron_rng[rank] = moved
    if neuron_rng:
        trees.extra["neuron_rng"] = neuron_rng


def move_xla_rng_in(trees: Trees) -> None:
    """Inverse of :func:`move_xla_rng_out`."""
    for rank, moved in trees.extra.pop("neuron_rng", {}).items():
        if isinstance(trees.rng.get(rank), dict):
            trees.rng[rank].update(moved)


__all__ = ["Trees", "XLA_RNG_KEYS", "move_xla_rng_in", "move_xla_rng_out", "rename_optimizer"]
