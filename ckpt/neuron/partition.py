"""Where each local NxD shard sits in its logical tensor: the layout hook of the Neuron saver and restorer.

Contract (docs/format.md, "Neuron (NxD) layout"): the logical tensor of a tensor-parallel parameter is the
concatenation of the TP ranks' local shards along its partition dim, TP rank ``r`` holding box ``r`` of ``tp``
equal boxes; its ``partition`` is ``{"dim", "stride", "tp", "source"}``.  Replicated parameters carry none.

The partition of a parameter comes from NxD's own runtime attributes (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``, set by its parallel layers) when the parameter has them, because they
are what NxD actually did; otherwise from a named rule set over NxD parameter names (``nxd-llama``), which is
what NxD's checkpoint converter assumes.  With expert parallelism (``ep_size > 1``) NxD's stacked expert tensors
(``mlp.expert_mlps.mlp_op.{gate_up,down}_proj.weight``, or any parameter NxD marks ``expert_model_parallel``) are
also split on dim 0 over EP ranks: EP rank ``k`` holds box ``k`` of ``ep`` equal boxes, and the partition says so
with ``"ep": ep_size``.  Optimizer states follow their parameter.  ZeRO-1 shards of optimizer
states are boxes too: rows ``[start, start + n)`` of the TP-local tensor (padding dropped), registered in
:attr:`NxdLayout.zero1_rows` by the optimizer capture.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt.errors import CkptError, LayoutError
from ckpt.format.manifest import Box
from ckpt.layouts.families import family_for_rule_set, rules_with
from ckpt.layouts.names import EXPERT_STACKED, nxd_to_hf_names
from ckpt.layouts.partition import Partition, nxd_partition
from ckpt.layouts.rules import check_known
from ckpt.saving.planning import Group
from ckpt.state.training import NamedTensor

from .parallel import ParallelInfo


def attribute_partition(param: torch.Tensor) -> tuple[int, int] | None | bool:
    """From NxD's attributes: ``(dim, stride)``, None for an explicitly non-parallel parameter, False if absent."""
    if not hasattr(param, "tensor_model_parallel"):
        return False
    if not param.tensor_model_parallel:
        return None
    dim = int(getattr(param, "partition_dim", 0))
    if dim < 0:
        dim += param.dim()
    return (dim, int(getattr(param, "partition_stride", 1)))


class NxdLayout:
    """The layout hook (``Checkpointer(layout_hook=...)`` / ``restore(layout_hook=...)``) for one NxD model.

    Args:
        model: the (TP-local, PP-stage) model; its parameters are looked up by name for NxD attributes.
        parallel: this process's ranks and sizes.
        rule_set: the rule set for parameters without NxD attributes (``"nxd-llama"``), or None to treat those as
            replicated.
        replicated: globs of parameters without NxD attributes that the rule set does not know and that are
            replicated on every TP rank; with TP > 1 any other unknown one is refused (:meth:`check`).
    """

    def __init__(
        self,
        model: Any,
        parallel: ParallelInfo,
        rule_set: str | None = "nxd-llama",
        replicated: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.replicated = tuple(replicated)
        if rule_set is not None:
            rules_with(rule_set, self.replicated)  # fail early on an unknown name or a bad glob
        self.parallel = parallel
        self.rule_set = rule_set
        self.params: dict[str, torch.Tensor] = {}
        if isinstance(model, torch.nn.Module):
            self.params = dict(model.named_parameters(remove_duplicate=False))
        self.zero1_rows: dict[str, tuple[int, tuple[int, ...]]] = {}
        # PP stages holding each parameter (set by the saver when PP > 1, from extra.nxd's pp_ranks)
        self.pp_ranks: dict[str, list[int]] | None = None
        self._cache: dict[str, Partition | None] = {}

    def check(self, names: list[str]) -> None:
        """Refuse (listing them) the tensors whose TP split neither NxD's attributes nor the rules say.

        With TP 1 nothing is split, so nothing can be misplaced and nothing is refused."""
        if self.rule_set is None or self.parallel.tp_size == 1:
            return
        family = family_for_rule_set(self.rule_set)
        unknown = [n for n in names if n not in self.params or attribute_partition(self.params[n]) is False]
        unknown = [n for n in unknown if not (family.experts is not None and EXPERT_STACKED.match(n))]
        check_known(
            (h for n in unknown for h in nxd_to_hf_names(n, family)), rules_with(self.rule_set, self.replicated),
            self.rule_set,
        )  # fmt: skip

    def partition(self, name: str) -> Partition | None:
        """The manifest ``partition`` of parameter ``name`` (None: replicated)."""
        if name in self._cache:
            return self._cache[name]
        found: tuple[int, int] | None | bool = False
        source = "attributes"
        param = self.params.get(name)
        if param is not None:
            found = attribute_partition(param)
        if found is False:
            source = self.rule_set or ""
            try:
                found = (
                    nxd_partition(name, self.rule_set, self.replicated) if self.rule_set is not None else None
                )
            except LayoutError:
                if self.parallel.tp_size > 1:
                    raise
                found = None  # TP 1: the tensor is whole on this rank whatever its rule would be
        part = None
        if found:
            dim, stride = found  # type: ignore[misc]
            part = {"dim": dim, "stride": stride, "tp": self.parallel.tp_size, "source": source}
            if self.parallel.ep_size > 1 and self._expert_parallel(name, param):
                part["ep"] = self.parallel.ep_size
        self._cache[name] = part
        return part

    def _expert_parallel(self, name: str, param: torch.Tensor | None) -> bool:
        """Whether parameter ``name`` is split over EP ranks (NxD's ``expert_model_parallel`` mark, else its name)."""
        if param is not None and hasattr(param, "expert_model_parallel"):
            return bool(param.expert_model_parallel)
        return EXPERT_STACKED.match(name) is not None

    def global_box(
        self, name: str, local_shape: tuple[int, ...], box: Box | None = None
    ) -> tuple[tuple[int, ...], Box, Partition | None]:
        """Logical shape and box of ``box`` (default: all) of the TP-local tensor of parameter ``name``."""
        box = box or Box.full(local_shape)
        part = self.partition(name)
        if part is None:
            return tuple(local_shape), box, None
        d = part["dim"]
        if d >= len(local_shape):
            raise CkptError(
                f"tensor {name!r}: partition dim {d} but the local tensor has shape {list(local_shape)}"
            )
        shape = list(local_shape)
        shape[d] *= self.parallel.tp_size
        offsets = list(box.offsets)
        offsets[d] += self.parallel.tp_rank * local_shape[d]
        if part.get("ep"):
            if d == 0:
                raise CkptError(f"tensor {name!r}: expert parallel on dim 0 and tensor parallel on dim 0 too")
            shape[0] *= self.parallel.ep_size
            offsets[0] += self.parallel.ep_rank * local_shape[0]
        return tuple(shape), Box(tuple(offsets), box.lengths), part

    def replica_group(self, nt: NamedTensor, partition: Partition | None) -> Group | None:
        """The ranks holding the same box as this rank (ckpt.saving.planning.Group), from the parallel state alone.

        Replicas differ from this rank only in DP rank (unless ZeRO-1 split the state over DP), TP rank (unless
        the tensor is TP-partitioned) and PP stage (a parameter several stages hold).  None under expert
        parallelism (not derived here: the saver then agrees on writers by exchanging descriptions).
        """
        p = self.parallel
        if p.ep_size > 1:
            return None
        base = nt.param if nt.role == "optimizer_state" and nt.param is not None else nt.name
        stages = tuple(self.pp_ranks.get(base, [p.pp_rank])) if self.pp_ranks else (p.pp_rank,)
        if p.pp_rank not in stages:
            return None
        zero1 = nt.name in self.zero1_rows
        split_tp = partition is not None
        size, index = len(stages), stages.index(p.pp_rank)
        if not zero1:
            size, index = size * p.dp_size, index * p.dp_size + p.dp_rank
        if not split_tp:
            size, index = size * p.tp_size, index * p.tp_size + p.tp_rank
        fixed = (p.tp_rank if split_tp else -1, p.dp_rank if zero1 else -1)
        return Group(("nxd", stages, p.tp_size, p.dp_size, fixed), size, index)

    def __call__(self, nt: NamedTensor) -> tuple[tuple[int, ...], Box, torch.Tensor, Partition | None] | None:
        base = nt.param if nt.role == "optimizer_state" and nt.param is not None else nt.name
        local = nt.tensor
        if nt.name in self.zero1_rows:
            start, tp_local = self.zero1_rows[nt.name]
            box = Box((start, *([0] * (len(tp_local) - 1))), tuple(local.shape))
            shape, gbox, part = self.global_box(base, tp_local, box)
            return shape, gbox, local, part
        if self.partition(base) is None:
            return None
        param = self.params.get(base)
        if nt.role == "optimizer_state" and param is not None and tuple(param.shape) != tuple(local.shape):
            raise CkptError(
                f"optimizer state {nt.name!r} has shape {list(local.shape)}, its TP-partitioned parameter "
                f"{list(param.shape)}: only states shaped like their parameter can follow its layout"
            )
        shape, gbox, part = self.global_box(base, tuple(local.shape))
        return shape, gbox, local, part
