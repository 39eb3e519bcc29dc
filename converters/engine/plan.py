"""Plans: which pieces of the source make each part of each target tensor.  No tensor data is touched here.

Every conversion is planned through the full (Hugging Face-named) view of the model, without ever building it:

* the *full view* of a source maps each full tensor to the source pieces it is made of: the identity for a
  CUDA-layout source, the layout engine's :func:`~ckpt.layouts.plan_nxd_to_full` for a Neuron one (TP merge with
  strides, fused ``gate_up``/``qkv`` split, KV replicas set aside as ``replicas`` to compare);
* a CUDA target is the full view itself; a Neuron target is :func:`~ckpt.layouts.plan_full_to_nxd` of the target
  layout, *composed* with the full view (:func:`compose`), so each target rank's tensor reads the source pieces
  directly: a TP-split tensor is read once and written once, never concatenated and cut again;
* a Neuron target with the source's own layout (its parallel flags; the DP size may differ) is the identity on
  rank tensors (:func:`plan_same_layout`): no model dimensions, no config needed, every stored copy compared.

Optimizer moments follow their parameter (same plan, renamed); the trees are renamed alongside (:mod:`.trees`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt.errors import LayoutError, StateMismatchError
from ckpt.format.dtypes import dtype_from_name, dtype_name
from ckpt.format.manifest import Box, Layout, TensorDesc
from ckpt.layouts import LayoutSpec, Piece, TensorMeta, TensorPlan, plan_full_to_nxd, plan_nxd_to_full
from ckpt.layouts.names import hf_to_nxd_name, nxd_to_hf_names
from ckpt.layouts.partition import partition_entry
from ckpt.layouts.pipeline import pp_ranks_of
from ckpt.layouts.record import NxdRecord
from ckpt.layouts.spec import ModelDims, NxdFlags
from ckpt.state.training import optim_name

from .compose import compose_all, dedup_replicas, rename_plan
from .experts import expert_view, hf_names, stacked_name, stacked_parts, with_expert_views
from .source import MODEL_ROLES, LayoutKind, Rank, Source
from .trees import Trees, move_xla_rng_in, move_xla_rng_out, rename_optimizer


@dataclass(frozen=True)
class OutPart:
    """One box of a target tensor and how to make it.  ``ranks``: the NxD (tp, pp) ranks that hold this box in
    NxD-native output (empty for CUDA targets)."""

    box: Box
    plan: TensorPlan
    ranks: tuple[Rank, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.plan.meta.dtype.itemsize


@dataclass(frozen=True)
class OutTensor:
    """One logical tensor of the target and its parts (TP boxes for a Neuron target, one box otherwise)."""

    desc: TensorDesc
    parts: tuple[OutPart, ...]


@dataclass
class Conversion:
    """A planned conversion: what is written, from which pieces; executing it touches one target part at a time."""

    source: Source
    to: LayoutKind
    tensors: list[OutTensor]
    trees: Trees
    config: dict[str, Any] | None = None
    #: Neuron targets: the target flags, ``extra.nxd`` and whether optimizer state is ZeRO-1 sharded
    flags: NxdFlags | None = None
    record: NxdRecord | None = None
    zero1: bool = False
    #: True when the target keeps the source's Neuron layout (rank tensors copied as they are)
    same_layout: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.desc.nbytes for t in self.tensors)

    def layout(self) -> tuple[str, Layout]:
        """``(backend, layout)`` of the target manifest."""
        if self.to == "neuron":
            f = self.flags
            assert f is not None
            return "neuron", Layout(
                world_size=f.tp * f.pp * f.dp, tp=f.tp, pp=f.pp, dp=f.dp, ep=f.ep,
                zero_stage=1 if self.zero1 else 0, kind="nxd",
            )  # fmt: skip
        return "cuda", Layout(world_size=self.trees.world_size, kind="replicated")


# ------------------------------------------------------------------------------------------------ full view


def _expert_views(source: Source, config: Mapping[str, Any] | None) -> Source:
    """A Neuron-layout source of an MoE model seen with per-expert views of its stacked expert tensors
    (:mod:`.experts`); any other source as it is."""
    if source.layout != "neuron":
        return source
    return with_expert_views(source, source.spec(config))


def _identity(desc: TensorDesc) -> TensorPlan:
    return TensorPlan(
        desc.name,
        None,
        TensorMeta(desc.shape, dtype_from_name(desc.dtype)),
        None,
        (Piece(desc.name, None, None),),
    )


def full_view(
    source: Source, config: Mapping[str, Any] | None = None
) -> dict[str, tuple[TensorDesc, TensorPlan]]:
    """Full (HF-named) tensor -> (its description, its plan over source pieces): model tensors, then optimizer
    states (``optim/<full name>/<key>``)."""
    if source.layout == "cuda":
        return {n: (d, _identity(d)) for n, d in source.tensors.items()}
    source = _expert_views(source, config)
    spec = source.spec(config)
    model = {n: d for n, d in source.tensors.items() if d.role in MODEL_ROLES}
    out: dict[str, tuple[TensorDesc, TensorPlan]] = {}
    for t in plan_nxd_to_full(spec, source.rank_metas()).tensors:
        src = model[hf_to_nxd_name(t.name, spec)]
        out[t.name] = (
            TensorDesc(t.name, src.role, t.meta.shape, dtype_name(t.meta.dtype)),
            dedup_replicas(source, t),
        )
    for param, keys in source.optimizer_states().items():
        if param not in model:
            raise StateMismatchError(
                f"{source.path}: optimizer state for {param!r}, which is not a parameter"
                + getattr(source, "optimizer_note", "")
            )
        for d in keys.values():
            if d.shape != model[param].shape:
                raise LayoutError(
                    f"{source.path}: {d.name} has shape {list(d.shape)}, its parameter {list(model[param].shape)}; "
                    "only optimizer states shaped like their parameter convert"
                )
        for hf in nxd_to_hf_names(param, spec.family):
            base = out[hf][1]
            for key, d in keys.items():
                name = optim_name(hf, key)
                plan = rename_plan(base, name, dtype_from_name(d.dtype), lambda n, k=key: optim_name(n, k))
                out[name] = (TensorDesc(name, "optimizer_state", base.meta.shape, d.dtype, hf, key), plan)
    return out


# ------------------------------------------------------------------------------------------------ targets


def plan_to_cuda(source: Source, *, config: Mapping[str, Any] | None = None) -> Conversion:
    """Plan the CUDA (full, HF-named) form of ``source``."""
    cfg = dict(config) if config is not None else source.config
    source = _expert_views(source, config)
    view = full_view(source, config)
    tensors = [OutTensor(desc, (OutPart(Box.full(desc.shape), plan),)) for desc, plan in view.values()]
    trees = copy.deepcopy(source.trees)
    if source.layout == "neuron":
        spec = source.spec(config)
        trees.optimizer = rename_optimizer(
            trees.optimizer, lambda n: [h for h in hf_names(n, spec) if h in view] or [n], False, source.path
        )
        nxd = trees.extra.pop("nxd", None)
        trees.extra["converted_from"] = {"layout": "neuron", "format": source.format, "nxd": nxd}
        if isinstance(trees.optimizer, dict) and "base" in trees.optimizer:
            # NxD's ZeRO-1 wrapper shards its base optimizer over DP ranks; full tensors are the base's state
            base = trees.optimizer.pop("base")
            trees.optimizer["type"] = base
        trees.world_size = 1  # one full copy, saved by no CUDA world: not the Neuron ranks it came from
    move_xla_rng_out(trees)
    if cfg is not None:
        trees.extra["config"] = dict(cfg)
    return Conversion(source, "cuda", tensors, trees, cfg)


def _tp_parts(
    plans: Mapping[Rank, TensorPlan], dim: int | None, tp: int, pps: tuple[int, ...], local: tuple[int, ...]
) -> tuple[OutPart, ...]:
    """The parts of one target tensor from its per-rank plans: TP box ``r`` per rank, or one box for all ranks."""
    if dim is None:
        ranks = tuple((t, p) for p in pps for t in range(tp))
        return (OutPart(Box.full(local), plans[(0, pps[0])], ranks),)
    parts = []
    for r in range(tp):
        offs = [0] * len(local)
        offs[dim] = r * local[dim]
        parts.append(OutPart(Box(tuple(offs), local), plans[(r, pps[0])], tuple((r, p) for p in pps)))
    return tuple(parts)


def _stacked_tensor(
    stacked: str,
    views: Mapping[int, Mapping[Rank, TensorPlan]],
    spec: LayoutSpec,
    declared: tuple[str, ...],
    full_plans: Mapping[str, TensorPlan],
    model: Mapping[str, TensorDesc],
    optim: Mapping[str, Any],
    pp_ranks: dict[str, list[int]],
) -> list[OutTensor]:
    """NxD's stacked MoE expert tensor ``stacked`` of a Neuron target, made of the plans of its per-expert views:
    one part per expert and TP rank (:func:`.experts.stacked_parts`); EP is recorded in its ``partition``.  Then its
    optimizer moments, stacked the same way from the experts' moments."""
    parts_hf = [h for j in sorted(views) for h in nxd_to_hf_names(f"{stacked}#{j}", spec.family)]
    pps = pp_ranks_of(stacked, spec)
    pp_ranks[stacked] = list(pps)
    part = partition_entry(stacked, spec.tp, spec.rule_set, declared)
    assert part is not None
    if spec.ep > 1:
        part = {**part, "ep": spec.ep}
    composed = {
        j: {rank: compose_all(plan, full_plans) for rank, plan in per.items()} for j, per in views.items()
    }
    shape, parts = stacked_parts(composed, int(part["dim"]), spec.tp, pps)
    first = composed[0][(0, pps[0])]
    desc = TensorDesc(stacked, model[parts_hf[0]].role, shape, dtype_name(first.meta.dtype), partition=part)
    out = [OutTensor(desc, tuple(OutPart(box, plan, ranks) for box, plan, ranks in parts))]
    keys = [optim.get(h, {}) for h in parts_hf]
    for key in dict.fromkeys(
        k for ks in keys for k in ks
    ):  # moments: the same parts, renamed (like dense tensors)
        descs = [ks.get(key) for ks in keys]
        if any(d is None for d in descs):
            missing = parts_hf[[d is None for d in descs].index(True)]
            raise StateMismatchError(f"{missing} has no optimizer state {key!r}, but {stacked} stacks it")
        dtypes = {d.dtype for d in descs if d is not None}
        if len(dtypes) > 1:
            raise LayoutError(f"optimizer state {key!r} of {stacked}'s experts has dtypes {sorted(dtypes)}")
        dt = dtypes.pop()
        name = optim_name(stacked, key)
        renamed = {
            j: {
                rank: compose_all(
                    rename_plan(
                        plan,
                        optim_name(plan.name, key),
                        dtype_from_name(dt),
                        lambda n, k=key: optim_name(n, k),
                    ),
                    full_plans,
                )
                for rank, plan in per.items()
            }
            for j, per in views.items()
        }
        _, oparts = stacked_parts(renamed, int(part["dim"]), spec.tp, pps)
        odesc = TensorDesc(name, "optimizer_state", shape, dt, stacked, key, part)
        out.append(OutTensor(odesc, tuple(OutPart(box, plan, ranks) for box, plan, ranks in oparts)))
    return out


def _logical(local: tuple[int, ...], dim: int | None, tp: int) -> tuple[int, ...]:
    shape = list(local)
    if dim is not None:
        shape[dim] *= tp
    return tuple(shape)


def plan_to_neuron(
    source: Source,
    flags: NxdFlags,
    *,
    config: Mapping[str, Any] | None = None,
    rule_set: str | None = None,
    replicated: tuple[str, ...] = (),
) -> Conversion:
    """Plan the Neuron (NxD TP/PP) form of ``source`` with ``flags``.

    Keeping the source's own layout (:meth:`NxdFlags.model_layout_equal`) copies rank tensors as they are and needs
    no config; any other layout goes through the full view and needs the model's dimensions.  Every model tensor
    must be known to the rule set or match a ``replicated`` glob (also those the source records), else the plan is
    refused listing the unknown names.
    """
    if source.layout == "neuron" and source.flags is not None and source.flags.model_layout_equal(flags):
        return plan_same_layout(source, flags, config=config)
    cfg = dict(config) if config is not None else source.config
    if not cfg:
        raise LayoutError(f"{source.path}: the model config is unknown; pass --config config.json")
    declared = tuple(
        dict.fromkeys((*(source.record.replicated if source.record is not None else ()), *replicated))
    )
    recorded = source.record.rule_set if source.record is not None else None
    spec = LayoutSpec.of(
        ModelDims.from_hf_config(cfg), flags, rule_set=rule_set or recorded, replicated=declared
    )
    source = _expert_views(source, config)
    rule = spec.rule_set  # the given or recorded one, else the model family's
    view = full_view(source, config)
    full_plans = {n: plan for n, (_, plan) in view.items()}
    model = {n: d for n, (d, _) in view.items() if d.role in MODEL_ROLES}
    metas = {n: TensorMeta(d.shape, dtype_from_name(d.dtype)) for n, d in model.items()}
    by_name: dict[str, dict[Rank, TensorPlan]] = {}
    for t in plan_full_to_nxd(spec, metas).tensors:
        assert t.rank is not None
        by_name.setdefault(t.name, {})[t.rank] = t
    optim = {}
    for d, _ in view.values():
        if d.role == "optimizer_state":
            assert d.param is not None and d.key is not None
            optim.setdefault(d.param, {})[d.key] = d
    tensors: list[OutTensor] = []
    pp_ranks: dict[str, list[int]] = {}
    views: dict[str, dict[int, dict[Rank, TensorPlan]]] = {}  # MoE: stacked name -> expert -> rank -> plan
    for nxd, per_rank in by_name.items():
        found = expert_view(nxd)
        if found is not None:
            views.setdefault(found[0], {})[found[1]] = per_rank
    for nxd, per_rank in by_name.items():
        found = expert_view(nxd)
        if found is not None:
            if found[1] == 0:  # the stacked tensor, where its first expert would be
                tensors.extend(
                    _stacked_tensor(
                        found[0], views[found[0]], spec, declared, full_plans, model, optim, pp_ranks
                    )
                )
            continue
        parts_hf = nxd_to_hf_names(nxd, spec.family)
        present = [h for h in parts_hf if h in model]
        pps = pp_ranks_of(nxd, spec)
        pp_ranks[nxd] = list(pps)
        first = per_rank[(0, pps[0])]
        part = partition_entry(nxd, spec.tp, spec.rule_set, declared)
        dim = None if part is None else int(part["dim"])
        composed = {rank: compose_all(plan, full_plans) for rank, plan in per_rank.items()}
        local = first.meta.shape
        tensors.append(
            OutTensor(
                TensorDesc(
                    nxd,
                    model[present[0]].role,
                    _logical(local, dim, spec.tp),
                    dtype_name(first.meta.dtype),
                    partition=part,
                ),  # fmt: skip
                _tp_parts(composed, dim, spec.tp, pps, local),
            )
        )
        keys = [optim.get(h, {}) for h in present]
        for key in dict.fromkeys(k for ks in keys for k in ks):
            descs = [ks.get(key) for ks in keys]
            if any(d is None for d in descs):
                missing = present[[d is None for d in descs].index(True)]
                raise StateMismatchError(
                    f"{source.path}: {missing} has no optimizer state {key!r}, but {nxd} fuses it"
                )
            dtypes = {d.dtype for d in descs if d is not None}
            if len(dtypes) > 1:
                raise LayoutError(
                    f"{source.path}: optimizer state {key!r} of {nxd}'s parts has dtypes {sorted(dtypes)}"
                )
            dt = dtypes.pop()
            name = optim_name(nxd, key)
            renamed = {
                rank: rename_plan(plan, name, dtype_from_name(dt), lambda n, k=key: optim_name(n, k))
                for rank, plan in per_rank.items()
            }
            tensors.append(
                OutTensor(
                    TensorDesc(name, "optimizer_state", _logical(local, dim, spec.tp), dt, nxd, key, part),
                    _tp_parts(
                        {r: compose_all(p, full_plans) for r, p in renamed.items()}, dim, spec.tp, pps, local
                    ),
                )
            )
    for param in optim:
        if param not in model:
            raise StateMismatchError(
                f"{source.path}: optimizer state for {param!r}, which is not a parameter"
                + getattr(source, "optimizer_note", "")
            )
    record = NxdRecord.of(
        flags, rule_set=rule, config=cfg, pp_ranks=pp_ranks if spec.pp > 1 else None, replicated=declared
    )
    trees = copy.deepcopy(source.trees)
    if source.layout == "neuron":
        src_spec = source.spec(config)
        trees.optimizer = rename_optimizer(
            trees.optimizer, lambda n: hf_names(n, src_spec), False, source.path
        )
        trees.extra.pop("nxd", None)
    trees.optimizer = rename_optimizer(
        trees.optimizer, lambda h: [stacked_name(hf_to_nxd_name(h, spec))], True, source.path
    )
    move_xla_rng_in(trees)
    trees.extra.pop("config", None)
    trees.extra["nxd"] = record.to_extra()
    return Conversion(
        source,
        "neuron",
        tensors,
        trees,
        cfg,
        flags=flags,
        record=record,
        zero1=flags.dp > 1 or _zero1(source, flags),
    )


def _zero1(source: Source, flags: NxdFlags) -> bool:
    """Keep a ZeRO-1 source's optimizer ZeRO-1 at an unchanged DP size (even DP 1)."""
    return bool(getattr(source, "zero1", False)) and source.flags is not None and source.flags.dp == flags.dp


def plan_same_layout(
    source: Source, flags: NxdFlags, *, config: Mapping[str, Any] | None = None
) -> Conversion:
    """Neuron -> Neuron keeping the layout: every rank tensor is copied as it is stored; replicated copies (every
    TP rank's norm, every PP rank's shared tensor) are compared, not trusted."""
    assert source.flags is not None and source.record is not None
    tp = flags.tp
    tensors: list[OutTensor] = []
    for name, desc in source.tensors.items():
        param = desc.param if desc.role == "optimizer_state" and desc.param is not None else name
        pps = source.pp_ranks(param)
        local = source.local_shape(desc)
        meta = TensorMeta(local, dtype_from_name(desc.dtype))
        dim = None if desc.partition is None else int(desc.partition["dim"])
        copies = [(r, p) for p in pps for r in range(tp)]

        def plan_of(ranks: list[Rank], name: str = name, meta: TensorMeta = meta) -> TensorPlan:
            canon, *rest = ranks
            plan = TensorPlan(
                name,
                canon,
                meta,
                None,
                (Piece(name, canon, None),),
                tuple((Piece(name, r, None),) for r in rest),
            )
            return dedup_replicas(source, plan)

        if dim is None:
            parts: tuple[OutPart, ...] = (OutPart(Box.full(local), plan_of(copies), tuple(copies)),)
        else:
            parts = tuple(
                OutPart(
                    Box(tuple(r * local[d] if d == dim else 0 for d in range(len(local))), local),
                    plan_of([(r, p) for p in pps]),
                    tuple((r, p) for p in pps),
                )
                for r in range(tp)
            )
        tensors.append(OutTensor(desc, parts))
    record = source.record
    if config is not None:
        record = dataclasses.replace(record, config=dict(config))
    trees = copy.deepcopy(source.trees)
    trees.extra["nxd"] = record.to_extra()
    trees.world_size = flags.tp * flags.pp * flags.dp
    return Conversion(
        source, "neuron", tensors, trees, record.config, flags=flags, record=record,
        zero1=flags.dp > 1 or _zero1(source, flags), same_layout=True,
    )  # fmt: skip


__all__ = [
    "Conversion",
    "OutPart",
    "OutTensor",
    "full_view",
    "plan_same_layout",
    "plan_to_cuda",
    "plan_to_neuron",
]
