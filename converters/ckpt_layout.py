"""Neuron (NxD) layout <-> CUDA (full, Hugging Face-named) layout of one checkpoint, streaming tensor by tensor.

Every foreign format is turned into a :class:`Source` (logical tensors plus the non-tensor state that must travel),
and every conversion goes through one *full view*: the checkpoint as full HF-named tensors.  A CUDA-layout source
is its own full view; a Neuron-layout source is mapped with the layout engine's ``plan_nxd_to_full`` (names, TP
merge with strides, fused ``gate_up``/``qkv`` split, KV replicas removed with the trn1/trn2 head pairing, PP).  A
Neuron target is made from the full view with ``plan_full_to_nxd``.  No layout rule lives here: only the
bookkeeping around the engine (logical tensor <-> per-rank box, optimizer moments renamed alongside their
parameter, param_groups/scalar state/RNG mapped by name).

Why streaming: a target tensor is built from a few source tensors (at most one fusion group: q, k, v of a layer),
read whole into a small LRU cache and sliced; nothing else is resident, so peak memory is a few tensors plus the
writer's flush buffer, whatever the model size.

Conventions (docs/format.md, "Neuron (NxD) layout"): in a Neuron-layout manifest a TP-partitioned tensor is the
concatenation of the TP ranks' shards along its partition dim, so TP rank ``r``'s shard is box ``r`` of ``tp``
equal boxes; replicated tensors are stored once; optimizer state ``optim/<param>/<key>`` has its parameter's
layout.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ckpt import treecodec
from ckpt.commit import Receipt
from ckpt.dtypes import dtype_from_name
from ckpt.errors import LayoutError, StateMismatchError
from ckpt.layouts import (
    LayoutSpec,
    Piece,
    TensorMeta,
    TensorPlan,
    execute,
    plan_full_to_nxd,
    plan_nxd_to_full,
)
from ckpt.layouts.names import hf_to_nxd_name, nxd_to_hf_names
from ckpt.layouts.pipeline import pp_ranks_of
from ckpt.layouts.rules import Kind, get_rule_set, rule_for
from ckpt.manifest import Box, Layout, Manifest
from ckpt.reader import CheckpointReader
from ckpt.state import OPTIM_PREFIX
from ckpt.storage import Storage
from ckpt.writer import StreamingWriter

LayoutKind = Literal["neuron", "cuda"]
MODEL_ROLES = ("parameter", "buffer")
RULE_SET = "nxd-llama"
#: rng record keys that only torch_xla can restore; kept as metadata (``extra.neuron_rng``) on the CUDA side.
XLA_RNG_KEYS = ("xla_seed", "xla_nxd_tracker")


# ------------------------------------------------------------------------------------------------ descriptions


@dataclass(frozen=True)
class TensorInfo:
    """One logical tensor as our manifest describes it (no data)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: str = "parameter"
    param: str | None = None
    key: str | None = None
    partition: dict[str, Any] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


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
            "tokenizer": self.tokenizer,
            "user": self.user,
            "extra": self.extra,
        }


class Source(ABC):
    """A checkpoint to convert from: logical tensors in its own naming, plus its trees.

    ``layout`` is ``"neuron"`` (NxD names, TP shards concatenated, ``spec`` set) or ``"cuda"`` (full HF-named
    tensors).  ``config`` is the HF ``config.json`` dict when known.  ``read`` returns one whole logical tensor.
    """

    layout: LayoutKind
    format: str
    path: str
    spec: LayoutSpec | None = None
    config: dict[str, Any] | None = None
    infos: dict[str, TensorInfo]
    trees: Trees

    @abstractmethod
    def read(self, name: str) -> torch.Tensor: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release open files."""


def spec_from_nxd_extra(
    nxd: Mapping[str, Any], layout: Layout, config: Mapping[str, Any] | None, where: str
) -> LayoutSpec:
    """The ``LayoutSpec`` a Neuron-layout manifest describes (``extra.nxd`` + ``layout``)."""
    rule_set = nxd.get("rule_set", RULE_SET)
    get_rule_set(str(rule_set))  # unknown rule set: one-line LayoutError
    cfg = config if config is not None else nxd.get("config")
    if not cfg:
        raise LayoutError(
            f"{where}: the checkpoint does not record the model config; pass --config config.json"
        )
    return LayoutSpec.from_hf_config(
        cfg,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        virtual_pp=int(nxd.get("virtual_pp", 1)),
        kv_size_multiplier=int(nxd.get("kv_size_multiplier", 1)),
        hw=nxd.get("hw", "trn1"),
        fuse_qkv=bool(nxd.get("fuse_qkv", False)),
        qkv_linear=bool(nxd.get("qkv_linear", False)),
    )


def nxd_extra(spec: LayoutSpec, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``extra.nxd`` for a Neuron-layout manifest (docs/format.md)."""
    return {
        "rule_set": RULE_SET,
        "kv_size_multiplier": spec.kv_size_multiplier,
        "hw": spec.hw,
        "fuse_qkv": spec.fuse_qkv,
        "qkv_linear": spec.qkv_linear,
        "virtual_pp": spec.virtual_pp,
        "config": dict(config) if config is not None else None,
    }


class ManifestSource(Source):
    """A committed checkpoint in our format (Neuron layout iff ``layout.kind == "nxd"``)."""

    format = "ckpt"

    def __init__(
        self,
        path: str | Storage,
        *,
        config: Mapping[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
    ) -> None:
        self.reader = CheckpointReader(path, storage_options, verify)
        m = self.reader.manifest
        self.path = self.reader.path
        self.trees = Trees.of_manifest(m)
        self.infos = {
            n: TensorInfo(n, tuple(e.shape), dtype_from_name(e.dtype), e.role, e.param, e.key, e.partition)
            for n, e in m.tensors.items()
        }
        nxd = m.extra.get("nxd")
        if m.layout.kind == "nxd" or (m.backend == "neuron" and isinstance(nxd, dict)):
            if not isinstance(nxd, dict):
                raise LayoutError(f"{self.path}: Neuron-layout checkpoint without extra.nxd; unknown layout")
            self.layout = "neuron"
            self.spec = spec_from_nxd_extra(nxd, m.layout, config, self.path)
            self.config = dict(config) if config is not None else nxd.get("config")
        elif m.layout.kind in ("replicated", "dtensor", "fsdp", "ddp", "cuda", "full") or m.layout.tp == 1:
            self.layout = "cuda"
            cfg = config if config is not None else m.extra.get("config")
            self.config = dict(cfg) if cfg else None
        else:
            raise LayoutError(
                f"{self.path}: unknown layout kind {m.layout.kind!r} with tp={m.layout.tp}; cannot convert it"
            )

    def read(self, name: str) -> torch.Tensor:
        return self.reader.read(name)


# ------------------------------------------------------------------------------------------------ helpers


def optim_tensor_name(param: str, key: str) -> str:
    return f"{OPTIM_PREFIX}{param}/{key}"


def nxd_partition_dim(nxd_name: str, spec: LayoutSpec) -> int | None:
    """Partition dim of an NxD tensor (None: replicated over TP), from the rule of the HF tensors it holds."""
    rule = rule_for(nxd_to_hf_names(nxd_name)[0])
    return None if rule.kind is Kind.REPLICATED else rule.partition_dim


def nxd_partition(nxd_name: str, spec: LayoutSpec) -> dict[str, Any] | None:
    """The ``partition`` metadata our Neuron-layout manifests carry for ``nxd_name``."""
    dim = nxd_partition_dim(nxd_name, spec)
    if dim is None:
        return None
    parts = nxd_to_hf_names(nxd_name)
    stride = rule_for(parts[0]).stride if len(parts) == 1 else len(parts)
    return {"dim": dim, "stride": stride, "tp": spec.tp, "source": RULE_SET}


class TensorCache:
    """A tiny LRU of whole source tensors: a fusion group (or the parts of a fused tensor) is read once."""

    def __init__(self, read: Callable[[str], torch.Tensor], capacity: int = 3) -> None:
        self._read = read
        self.capacity = capacity
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, name: str) -> torch.Tensor:
        t = self._items.get(name)
        if t is None:
            t = self._read(name)
            self._items[name] = t
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(name)
        return t

    def clear(self) -> None:
        self._items.clear()


def _rename_plan(plan: TensorPlan, name: str, dtype: torch.dtype, rename: Callable[[str], str]) -> TensorPlan:
    def pieces(ps: tuple[Piece, ...]) -> tuple[Piece, ...]:
        return tuple(dataclasses.replace(p, name=rename(p.name)) for p in ps)

    return dataclasses.replace(
        plan,
        name=name,
        meta=TensorMeta(plan.meta.shape, dtype),
        pieces=pieces(plan.pieces),
        replicas=tuple(pieces(r) for r in plan.replicas),
    )


def _optimizer_keys(infos: Mapping[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    """``{param: {key: info}}`` of the optimizer-state tensors."""
    out: dict[str, dict[str, TensorInfo]] = {}
    for info in infos.values():
        if info.role == "optimizer_state":
            if info.param is None or info.key is None:
                raise StateMismatchError(
                    f"optimizer tensor {info.name!r} does not name its parameter and key"
                )
            out.setdefault(info.param, {})[info.key] = info
    return out


# ------------------------------------------------------------------------------------------------ full view


class FullView:
    """The source as full, HF-named tensors (model and optimizer state), built lazily one tensor at a time."""

    def __init__(self, source: Source, *, verify_replicas: bool = True) -> None:
        self.source = source
        self.verify_replicas = verify_replicas
        self._cache = TensorCache(source.read, capacity=2)
        self.plans: dict[str, TensorPlan] = {}
        if source.layout == "cuda":
            self.infos = dict(source.infos)
            return
        spec = source.spec
        assert spec is not None
        model = {n: i for n, i in source.infos.items() if i.role in MODEL_ROLES}
        rank_metas: dict[tuple[int, int], dict[str, TensorMeta]] = {r: {} for r in spec.ranks}
        for n, info in model.items():
            dim = nxd_partition_dim(n, spec)
            shape = list(info.shape)
            if dim is not None:
                if shape[dim] % spec.tp:
                    raise LayoutError(
                        f"{source.path}: {n} has {shape[dim]} along its partition dim {dim}, not a multiple of "
                        f"--tp {spec.tp}"
                    )
                shape[dim] //= spec.tp
            for pp in pp_ranks_of(n, spec):
                for tp in range(spec.tp):
                    rank_metas[(tp, pp)][n] = TensorMeta(tuple(shape), info.dtype)
        plan = plan_nxd_to_full(spec, rank_metas)
        self.infos = {}
        for t in plan.tensors:
            src = model[hf_to_nxd_name(t.name, spec)]
            self.infos[t.name] = TensorInfo(t.name, t.meta.shape, t.meta.dtype, src.role)
            self.plans[t.name] = t
        for param, keys in _optimizer_keys(source.infos).items():
            if param not in model:
                raise StateMismatchError(
                    f"{source.path}: optimizer state for {param!r}, which is not a parameter"
                )
            for hf in nxd_to_hf_names(param):
                base = self.plans[hf]
                for key, info in keys.items():
                    if info.shape != model[param].shape:
                        raise LayoutError(
                            f"{source.path}: {info.name} has shape {list(info.shape)}, its parameter "
                            f"{list(model[param].shape)}; only optimizer states shaped like their parameter convert"
                        )
                    name = optim_tensor_name(hf, key)
                    self.plans[name] = _rename_plan(
                        base, name, info.dtype, lambda n, k=key: optim_tensor_name(n, k)
                    )
                    self.infos[name] = TensorInfo(name, base.meta.shape, info.dtype, info.role, hf, key)

    def _read_piece(self, piece: Piece) -> torch.Tensor:
        spec = self.source.spec
        assert spec is not None and piece.rank is not None
        t = self._cache.get(piece.name)
        if piece.dim is None:
            return t
        local = t.shape[piece.dim] // spec.tp
        return t.narrow(piece.dim, piece.rank[0] * local + piece.start, piece.length)

    def read(self, name: str) -> torch.Tensor:
        """Full tensor ``name`` (HF naming; optimizer state ``optim/<hf name>/<key>``)."""
        if self.source.layout == "cuda":
            return self.source.read(name)
        return execute(self.plans[name], self._read_piece, verify_replicas=self.verify_replicas)

    def sources_of(self, name: str) -> tuple[str, ...]:
        """Source tensors read to build ``name`` (for planning peak memory)."""
        if self.source.layout == "cuda":
            return (name,)
        return tuple(dict.fromkeys(n for _, n in self.plans[name].sources))


# ------------------------------------------------------------------------------------------------ targets


@dataclass(frozen=True)
class OutTensor:
    """One logical tensor of the target: ``parts`` are ``(box, plan)``; a ``None`` plan copies full tensor
    ``copy_of`` of the full view (the box is then the whole tensor)."""

    info: TensorInfo
    parts: tuple[tuple[Box, TensorPlan | None], ...]
    copy_of: str | None = None
    #: for NxD-native output: ``(tp, pp)`` ranks holding each part (index-aligned with ``parts``)
    ranks: tuple[tuple[tuple[int, int], ...], ...] = ()


@dataclass
class Conversion:
    """A planned conversion: what is written, from what; executing it touches one target tensor at a time."""

    view: FullView
    to: LayoutKind
    spec: LayoutSpec | None
    config: dict[str, Any] | None
    tensors: list[OutTensor]
    trees: Trees

    @property
    def nbytes(self) -> int:
        return sum(t.info.nbytes for t in self.tensors)

    def peak_bytes_estimate(self, flush_bytes: int = 0) -> int:
        """Largest working set of one target tensor: its sources (cached) plus itself, plus the writer buffer."""
        infos = self.view.source.infos
        peak = 0
        for t in self.tensors:
            names = [t.copy_of] if t.copy_of else [p.name for _, plan in t.parts if plan for p in plan.pieces]
            full = set()
            for n in dict.fromkeys(names):
                full.update(self.view.sources_of(n) if n in self.view.infos else ())
            src = sum(infos[n].nbytes for n in full if n in infos)
            views = sum(self.view.infos[n].nbytes for n in set(names) if n in self.view.infos)
            if self.view.source.layout == "cuda":
                views = 0
            peak = max(peak, src + views + 2 * t.info.nbytes)
        return peak + flush_bytes

    def produce(self, out: OutTensor, cache: TensorCache) -> Iterator[tuple[Box, torch.Tensor]]:
        """The boxes of target tensor ``out`` with their data."""
        if out.copy_of is not None:
            yield out.parts[0][0], cache.get(out.copy_of)
            return

        def read(piece: Piece) -> torch.Tensor:
            t = cache.get(piece.name)
            return t if piece.dim is None else t.narrow(piece.dim, piece.start, piece.length)

        for box, plan in out.parts:
            assert plan is not None
            if len(plan.pieces) == 1 and plan.pieces[0].dim in (None, 0):
                # one dim-0 slice of a contiguous source is already contiguous: hand the view to the writer
                # instead of copying it (the layout engine's execute always copies, for callers that keep results)
                t = read(plan.pieces[0])
                if tuple(t.shape) == plan.meta.shape and t.dtype == plan.meta.dtype and t.is_contiguous():
                    yield box, t
                    continue
            yield box, execute(plan, read)


def plan_to_cuda(source: Source, *, config: Mapping[str, Any] | None = None) -> Conversion:
    """Plan the CUDA (full, HF-named) form of ``source``."""
    view = FullView(source)
    tensors = [
        OutTensor(info, ((Box.full(info.shape), None),), copy_of=name) for name, info in view.infos.items()
    ]
    cfg = dict(config) if config is not None else source.config
    trees = map_trees_to_cuda(source, view, cfg)
    return Conversion(view, "cuda", None, cfg, tensors, trees)


def plan_to_neuron(
    source: Source, spec: LayoutSpec, *, config: Mapping[str, Any] | None = None
) -> Conversion:
    """Plan the Neuron (NxD TP/PP) form of ``source`` for ``spec``."""
    view = FullView(source)
    model = {n: i for n, i in view.infos.items() if i.role in MODEL_ROLES}
    metas = {n: TensorMeta(i.shape, i.dtype) for n, i in model.items()}
    plan = plan_full_to_nxd(spec, metas)
    by_name: dict[str, dict[tuple[int, int], TensorPlan]] = {}
    for t in plan.tensors:
        assert t.rank is not None
        by_name.setdefault(t.name, {})[t.rank] = t
    optim = _optimizer_keys(view.infos)
    tensors: list[OutTensor] = []
    for nxd, per_rank in by_name.items():
        parts_hf = nxd_to_hf_names(nxd)
        present = [h for h in parts_hf if h in model]
        role = model[present[0]].role
        pps = pp_ranks_of(nxd, spec)
        dim = nxd_partition_dim(nxd, spec)
        first = per_rank[(0, pps[0])]
        local = first.meta.shape

        def layout_parts(
            rename: Callable[[TensorPlan], TensorPlan],
            dim: int | None = dim,
            pps: tuple[int, ...] = pps,
            per_rank: dict[tuple[int, int], TensorPlan] = per_rank,
            local: tuple[int, ...] = local,
        ) -> tuple[
            tuple[tuple[Box, TensorPlan | None], ...],
            tuple[int, ...],
            tuple[tuple[tuple[int, int], ...], ...],
        ]:
            if dim is None:
                ranks = tuple((tp, pp) for pp in pps for tp in range(spec.tp))
                return ((Box.full(local), rename(per_rank[(0, pps[0])])),), local, (ranks,)
            shape = list(local)
            shape[dim] *= spec.tp
            parts = []
            ranks = []
            for tp in range(spec.tp):
                offs = [0] * len(local)
                offs[dim] = tp * local[dim]
                parts.append((Box(tuple(offs), tuple(local)), rename(per_rank[(tp, pps[0])])))
                ranks.append(tuple((tp, pp) for pp in pps))
            return tuple(parts), tuple(shape), tuple(ranks)

        parts, shape, ranks = layout_parts(lambda p: p)
        tensors.append(
            OutTensor(
                TensorInfo(nxd, shape, first.meta.dtype, role, partition=nxd_partition(nxd, spec)),
                parts,
                None,
                ranks,
            )
        )
        keys = [optim.get(h, {}) for h in present]
        all_keys = list(dict.fromkeys(k for ks in keys for k in ks))
        for key in all_keys:
            infos = [ks.get(key) for ks in keys]
            if any(i is None for i in infos):
                missing = present[[i is None for i in infos].index(True)]
                raise StateMismatchError(
                    f"{source.path}: {missing} has no optimizer state {key!r}, but {nxd} fuses it"
                )
            dtypes = {i.dtype for i in infos if i is not None}
            if len(dtypes) > 1:
                raise LayoutError(
                    f"{source.path}: optimizer state {key!r} of {nxd}'s parts has dtypes {sorted(map(str, dtypes))}"
                )
            for h, i in zip(present, infos, strict=True):
                assert i is not None
                if i.shape != model[h].shape:
                    raise LayoutError(
                        f"{source.path}: {i.name} has shape {list(i.shape)}, its parameter {list(model[h].shape)}; "
                        "only optimizer states shaped like their parameter convert"
                    )
            dtype = dtypes.pop()
            name = optim_tensor_name(nxd, key)
            oparts, oshape, oranks = layout_parts(
                lambda p, name=name, dtype=dtype, key=key: _rename_plan(
                    p, name, dtype, lambda n, key=key: optim_tensor_name(n, key)
                )
            )
            tensors.append(
                OutTensor(
                    TensorInfo(name, oshape, dtype, "optimizer_state", nxd, key, nxd_partition(nxd, spec)),
                    oparts,
                    None,
                    oranks,
                )
            )
    for param in optim:
        if param not in model:
            raise StateMismatchError(
                f"{source.path}: optimizer state for {param!r}, which is not a parameter"
            )
    cfg = dict(config) if config is not None else source.config
    trees = map_trees_to_neuron(source, view, spec, cfg)
    return Conversion(view, "neuron", spec, cfg, tensors, trees)


# ------------------------------------------------------------------------------------------------ trees


def _map_optimizer(
    opt: dict[str, Any] | None, expand: Callable[[str], list[str]], merge_scalars: bool, where: str
) -> dict[str, Any] | None:
    """param_groups (names) and per-parameter scalar state renamed with ``expand`` (one name -> its new names)."""
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


def map_trees_to_cuda(source: Source, view: FullView, config: dict[str, Any] | None) -> Trees:
    """Trees of the CUDA form: names NxD -> HF, XLA RNG moved to ``extra.neuron_rng`` (only torch_xla restores it)."""
    trees = copy.deepcopy(source.trees)
    if source.layout == "neuron":
        spec = source.spec
        assert spec is not None
        present = set(view.infos)
        trees.optimizer = _map_optimizer(
            trees.optimizer,
            lambda n: [h for h in nxd_to_hf_names(n) if h in present] or [n],
            False,
            source.path,
        )
        nxd = trees.extra.pop("nxd", None)
        trees.extra["converted_from"] = {"layout": "neuron", "format": source.format, "nxd": nxd}
    neuron_rng: dict[str, Any] = {}
    for rank, rec in trees.rng.items():
        if isinstance(rec, dict):
            moved = {k: rec.pop(k) for k in XLA_RNG_KEYS if k in rec}
            if moved:
                neuron_rng[rank] = moved
    if neuron_rng:
        trees.extra["neuron_rng"] = neuron_rng
    if config is not None:
        trees.extra["config"] = dict(config)
    return trees


def map_trees_to_neuron(
    source: Source, view: FullView, spec: LayoutSpec, config: dict[str, Any] | None
) -> Trees:
    """Trees of the Neuron form: names HF -> NxD (fused parameters share one entry), XLA RNG put back."""
    trees = copy.deepcopy(source.trees)
    if source.layout == "neuron":
        src_spec = source.spec
        assert src_spec is not None
        # to full names first, then to the target's
        trees.optimizer = _map_optimizer(
            trees.optimizer, lambda n: list(nxd_to_hf_names(n)), False, source.path
        )
        trees.extra.pop("nxd", None)
    trees.optimizer = _map_optimizer(trees.optimizer, lambda h: [hf_to_nxd_name(h, spec)], True, source.path)
    for rank, moved in trees.extra.pop("neuron_rng", {}).items():
        if isinstance(trees.rng.get(rank), dict):
            trees.rng[rank].update(moved)
    trees.extra.pop("config", None)
    trees.extra["nxd"] = nxd_extra(spec, config)
    return trees


# ------------------------------------------------------------------------------------------------ execution


def assign_shares(tensors: list[OutTensor], workers: int) -> list[list[int]]:
    """Indices of ``tensors`` per worker, balanced by bytes (largest first onto the lightest worker)."""
    loads = [0] * workers
    shares: list[list[int]] = [[] for _ in range(workers)]
    for i in sorted(range(len(tensors)), key=lambda i: -tensors[i].info.nbytes):
        w = loads.index(min(loads))
        shares[w].append(i)
        loads[w] += tensors[i].info.nbytes
    return [sorted(s) for s in shares]


def write_share(
    conv: Conversion,
    writer: StreamingWriter,
    indices: list[int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Receipt:
    """Write target tensors ``indices`` (all by default) with ``writer``; return its receipt."""
    cache = TensorCache(conv.view.read, capacity=3)
    for i in indices if indices is not None else range(len(conv.tensors)):
        out = conv.tensors[i]
        info = out.info
        for box, data in conv.produce(out, cache):
            writer.add(
                info.name,
                data,
                role=info.role,
                shape=info.shape,
                box=box,
                param=info.param,
                key=info.key,
                partition=info.partition,
            )
        if progress is not None:
            progress(info.nbytes)
    return writer.finish()


def target_layout(conv: Conversion) -> tuple[str, Layout]:
    """``(backend, layout)`` of the target manifest."""
    if conv.to == "neuron":
        spec = conv.spec
        assert spec is not None
        return "neuron", Layout(
            world_size=spec.tp * spec.pp * spec.dp,
            tp=spec.tp,
            pp=spec.pp,
            dp=spec.dp,
            zero_stage=1 if spec.dp > 1 else 0,
            kind="nxd",
        )
    return "cuda", Layout(world_size=conv.trees.world_size, kind="replicated")


def metas_of(conv: Conversion) -> list[Any]:
    """Commit metas of every target tensor."""
    from ckpt.commit import TensorMeta as CommitMeta
    from ckpt.dtypes import dtype_name

    return [
        CommitMeta(
            t.info.name,
            t.info.role,
            t.info.shape,
            dtype_name(t.info.dtype),
            t.info.param,
            t.info.key,
            t.info.partition,
        )
        for t in conv.tensors
    ]


def commit(conv: Conversion, storage: Storage, receipts: list[Receipt]) -> Manifest:
    """Write the manifest of ``conv`` from every writer's receipt (create-only): the commit point."""
    from ckpt.commit import build_manifest, publish

    backend, layout = target_layout(conv)
    manifest = build_manifest(
        step=conv.trees.step,
        backend=backend,
        layout=layout,
        metas=metas_of(conv),
        receipts=receipts,
        trees=conv.trees.as_commit_trees(),
        env=conv.trees.environment or None,
    )
    publish(storage, manifest)
    return manifest


def decode_tree(value: Any) -> Any:
    """Decode an encoded tree (helper for writers of foreign formats)."""
    return treecodec.decode(value) if value is not None else None
