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
from dataclasses import Field, field, fields, make_dataclass
from typing import Any

from ckpt.errors import LayoutError
from ckpt.format.manifest import Manifest

#: rng record keys that only torch_xla can restore; kept as metadata (``extra.neuron_rng``) on the CUDA side.
XLA_RNG_KEYS = ("xla_seed", "xla_nxd_tracker")


#: Manifest members that are not trees: the tensors, the files and the layout (written anew by the commit), and what
#: the commit itself stamps.  Every other member of :class:`~ckpt.format.manifest.Manifest` is a tree.
NOT_TREES = frozenset(
    {"step", "created_at", "backend", "layout", "tensors", "files", "adapter", "format_version", "v2"}
)
TREE_NAMES = tuple(f.name for f in fields(Manifest) if f.name not in NOT_TREES)
"""The trees, in the manifest's order: the fields of :class:`Trees` besides ``step`` and ``world_size``."""


class _TreesMethods:
    step: int
    world_size: int
    progress: dict[str, Any]
    environment: dict[str, Any]

    @classmethod
    def of_manifest(cls, m: Manifest) -> Trees:
        trees = {n: copy.deepcopy(getattr(m, n)) for n in TREE_NAMES}
        trees["progress"] = trees["progress"] or {"step": m.step}
        return cls(step=m.step, world_size=m.layout.world_size, **trees)  # type: ignore[call-arg,return-value]

    def as_commit_trees(self) -> dict[str, Any]:
        """The trees as :func:`ckpt.format.publish.build_manifest` takes them (the environment goes as ``env``)."""
        out = {n: getattr(self, n) for n in TREE_NAMES if n != "environment"}
        out["progress"] = self.progress or {"step": self.step}
        return out


def _field(f: Field[Any]) -> Any:
    return field(default=f.default, default_factory=f.default_factory)


Trees = make_dataclass(
    "Trees",
    [("step", int, field(default=0))]
    + [(f.name, f.type, _field(f)) for f in fields(Manifest) if f.name in TREE_NAMES]
    + [("world_size", int, field(default=1))],
    bases=(_TreesMethods,),
)
Trees.__module__ = __name__
Trees.__doc__ = """Everything that is not a model/optimizer tensor, in manifest (encoded) form, so that it travels losslessly:
``step``, the manifest's trees (:data:`TREE_NAMES`, with the manifest's types and defaults) and ``world_size``."""


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


__all__ = ["TREE_NAMES", "Trees", "XLA_RNG_KEYS", "move_xla_rng_in", "move_xla_rng_out", "rename_optimizer"]
