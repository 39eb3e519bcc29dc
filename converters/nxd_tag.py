"""NxD-native tags as a Neuron-layout source, and NxD-native output, on top of ``ckpt.converters.nxd``.

Reading uses :func:`ckpt.converters.nxd.open_tag` (lazy per rank, ZeRO-1 merged over DP, pids named) and presents
each NxD tensor as our manifest's logical tensor (TP shards concatenated along the partition dim); the layout
engine does the rest.  Parallel flags the files do not record are detected from names and shapes (``qkv_linear``,
``fuse_qkv``, ``kv_size_multiplier``, ``virtual_pp``) or taken from the caller (``hw``; ``config`` is required).

Memory: NxD stores one file per rank, so a logical tensor needs the files of all TP ranks of its PP stage; those
are cached (``tp`` model files and ``tp`` merged optimizer files at a time, plain files memory-mapped).  Peak
memory is therefore one PP stage's rank files, not a few tensors (NxD's file layout does not allow less without
re-reading every file per tensor).

Writing NxD-native tags (:func:`write_nxd`) streams rank by rank: each (tp, pp) rank's model shard and optimizer
are produced from the conversion plan and handed to :class:`ckpt.converters.nxd.writer.TagWriter` (atomic temp
folder + rename, ``done`` last), so memory is one rank's state plus a small cache of source tensors.  Parallel
(:class:`NxdExport`): workers write whole ranks into the coordinator's temp tag folder, which it then finishes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt import treecodec
from ckpt.errors import CkptError, LayoutError
from ckpt.layouts import LayoutSpec
from ckpt.layouts.pipeline import layer_index, layers_of_pp_rank, pp_ranks_of

from .ckpt_layout import Conversion, Source, TensorCache, TensorInfo, Trees, nxd_partition, nxd_partition_dim
from .fsutil import check_dst_free, remove_dir
from .parallel import UnitReceipt, check_cover, write_serial


def is_nxd_dir(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_dir():
        return False
    try:
        from ckpt.converters.nxd.files import scan_tag

        files = scan_tag(p)
    except Exception:  # noqa: BLE001 - not a tag
        return False
    return bool(files.model or files.legacy)


def _detect_flags(
    names: set[str], shapes: dict[str, tuple[int, ...]], config: dict[str, Any], tp: int
) -> dict[str, Any]:
    qkv_linear = any(".qkv_proj.weight_" in n for n in names)
    fuse = any(n.endswith("qkv_proj.weight_qkv") or n.endswith("qkv_proj.weight") for n in names)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    mult = 1
    if qkv_linear:
        k = next((n for n in names if n.endswith("qkv_proj.weight_k")), None)
        qkv = next((n for n in names if n.endswith("qkv_proj.weight_qkv")), None)
        if k is not None:
            kv_local = shapes[k][0]
        elif qkv is not None:
            kv_local = (shapes[qkv][0] - heads // tp * hd) // 2
        else:
            kv_local = kv_heads * hd // tp
        slots = kv_local * tp // hd
        mult = max(1, slots // kv_heads)
    return {"qkv_linear": qkv_linear, "fuse_qkv": fuse, "kv_size_multiplier": mult}


class NxdTagSource(Source):
    """An NxD tag (training checkpoint or converter output) as a Neuron-layout source."""

    layout = "neuron"
    format = "nxd"

    def __init__(
        self,
        path: str | Path,
        *,
        config: dict[str, Any] | None,
        hw: str = "trn1",
        kv_size_multiplier: int | None = None,
        virtual_pp: int | None = None,
        qkv_linear: bool | None = None,
        fuse_qkv: bool | None = None,
    ) -> None:
        from ckpt.converters.nxd import open_tag

        self.path = str(path)
        if not config:
            raise LayoutError(f"{path}: NxD tags do not record the model config; pass --config config.json")
        self.config = dict(config)
        self.r = open_tag(path)
        meta = self.r.meta
        if meta.ep_size > 1:
            raise LayoutError(
                f"{path}: expert parallelism (ep={meta.ep_size}) is not supported by the converter"
            )
        tp, pp = meta.tp_size, meta.pp_size
        per_rank_shapes = {(t, p): dict(self.r.model_shapes((t, p, 0))) for t in range(tp) for p in range(pp)}
        names = {n for d in per_rank_shapes.values() for n in d}
        shapes = {n: s for d in per_rank_shapes.values() for n, s in d.items()}
        flags = _detect_flags(names, shapes, self.config, tp)
        if kv_size_multiplier is not None:
            flags["kv_size_multiplier"] = kv_size_multiplier
        if qkv_linear is not None:
            flags["qkv_linear"] = qkv_linear
        if fuse_qkv is not None:
            flags["fuse_qkv"] = fuse_qkv
        layers_on = {
            p: sorted({li for n in per_rank_shapes[(0, p)] if (li := layer_index(n)) is not None})
            for p in range(pp)
        }
        candidates = (
            [virtual_pp] if virtual_pp else range(1, max(1, int(self.config["num_hidden_layers"]) // pp) + 1)
        )
        spec = None
        for v in candidates:
            try:
                s = LayoutSpec.from_hf_config(
                    self.config, tp=tp, pp=pp, dp=meta.dp_size, virtual_pp=v, hw=hw, **flags
                )
            except LayoutError:
                if virtual_pp:
                    raise
                continue
            if all(list(layers_of_pp_rank(s, p)) == layers_on[p] for p in range(pp)):
                spec = s
                break
        if spec is None:
            raise LayoutError(
                f"{path}: layer placement over pp ranks matches no --virtual-pp; pass --virtual-pp"
            )
        self.spec = spec
        self._shapes = per_rank_shapes
        self._models: OrderedDict[tuple[int, int], dict[str, torch.Tensor]] = OrderedDict()
        self._optims: OrderedDict[tuple[int, int], dict[str, Any] | None] = OrderedDict()
        self.infos = {}
        order: list[str] = []
        for p in range(pp):
            order.extend(n for n in per_rank_shapes[(0, p)] if n not in order)
        for n in order:
            local = per_rank_shapes[(0, pp_ranks_of(n, spec)[0])][n]
            dim = nxd_partition_dim(n, spec)
            shape = list(local)
            if dim is not None:
                shape[dim] *= tp
            self.infos[n] = TensorInfo(
                n, tuple(shape), self._model_dtype(n), "parameter", partition=nxd_partition(n, spec)
            )
        self.trees = self._trees(order)

    def _model_dtype(self, name: str) -> torch.dtype:
        return self._model((0, pp_ranks_of(name, self.spec)[0]))[name].dtype  # type: ignore[arg-type]

    def _model(self, rank: tuple[int, int]) -> dict[str, torch.Tensor]:
        d = self._models.get(rank)
        if d is None:
            d = self._models[rank] = self.r.model((*rank, 0))
            while len(self._models) > self.r.meta.tp_size:
                self._models.popitem(last=False)
        return d

    def _optim(self, rank: tuple[int, int]) -> dict[str, Any] | None:
        if rank not in self._optims:
            self._optims[rank] = self.r.optimizer((*rank, 0))
            while len(self._optims) > self.r.meta.tp_size:
                self._optims.popitem(last=False)
        return self._optims[rank]

    def _trees(self, order: list[str]) -> Trees:
        spec = self.spec
        assert spec is not None
        meta = self.r.meta
        optimizer = None
        groups: list[dict[str, Any]] = []
        scalars: dict[str, dict[str, Any]] = {}
        for p in range(spec.pp):
            opt = self._optim((0, p))
            if opt is None:
                continue
            for gi, g in enumerate(opt["param_groups"]):
                if gi >= len(groups):
                    enc = {
                        k: treecodec.encode(v, f"param_groups[{gi}].{k}")
                        for k, v in g.items()
                        if k != "params"
                    }
                    enc["params"] = []
                    groups.append(enc)
                groups[gi]["params"].extend(n for n in g["params"] if n not in groups[gi]["params"])
            for n, per in opt["state"].items():
                for key, v in per.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        self.infos.setdefault(
                            f"optim/{n}/{key}",
                            TensorInfo(
                                f"optim/{n}/{key}",
                                self.infos[n].shape,
                                v.dtype,
                                "optimizer_state",
                                n,
                                key,
                                self.infos[n].partition,
                            ),
                        )
                    else:
                        scalars.setdefault(n, {})[key] = treecodec.encode(v, f"state[{n}].{key}")
            for n, v in (opt.get("master_weights") or {}).items():
                name = f"optim/{n}/master_weight"
                self.infos[name] = TensorInfo(
                    name,
                    self.infos[n].shape,
                    v.dtype,
                    "optimizer_state",
                    n,
                    "master_weight",
                    self.infos[n].partition,
                )
        if groups:
            optimizer = {"type": "torch.optim.AdamW", "param_groups": groups, "state": scalars}
        sched = self.r.scheduler()
        user = self.r.user_content()
        step = meta.step
        if step is None and isinstance(user, dict) and isinstance(user.get("total_steps"), int):
            step = user["total_steps"]
        step = int(step or 0)
        return Trees(
            step=step,
            optimizer=optimizer,
            scheduler=treecodec.encode(sched, "scheduler") if sched is not None else None,
            progress={"step": step},
            user=treecodec.encode(user, "user_content") if user is not None else None,
            extra={
                "nxd": {
                    "rule_set": "nxd-llama",
                    "kv_size_multiplier": spec.kv_size_multiplier,
                    "hw": spec.hw,
                    "fuse_qkv": spec.fuse_qkv,
                    "qkv_linear": spec.qkv_linear,
                    "virtual_pp": spec.virtual_pp,
                    "config": self.config,
                },
                "nxd_tag": {"path": self.path, "zero1": meta.zero1, "xser": meta.xser, "dp": meta.dp_size},
            },
            world_size=spec.tp * spec.pp * meta.dp_size,
        )

    def read(self, name: str) -> torch.Tensor:
        spec = self.spec
        assert spec is not None
        info = self.infos[name]
        param = info.param if info.role == "optimizer_state" else name
        assert param is not None
        pp = pp_ranks_of(param, spec)[0]
        dim = nxd_partition_dim(param, spec)
        parts = []
        for tp in range(spec.tp if dim is not None else 1):
            if info.role == "optimizer_state":
                opt = self._optim((tp, pp))
                if opt is None:
                    raise CkptError(f"{self.path}: no optimizer for tp {tp} pp {pp}")
                t = (
                    opt["master_weights"][param]
                    if info.key == "master_weight"
                    else opt["state"][param][info.key]
                )
            else:
                t = self._model((tp, pp))[name]
            parts.append(t)
        return parts[0].clone() if dim is None else torch.cat(parts, dim=dim)


def open_nxd(path: str | Path, **kw: Any) -> NxdTagSource:
    """A Neuron-layout source over an NxD tag (see :class:`NxdTagSource`)."""
    return NxdTagSource(path, **kw)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy when it is a view into a bigger storage (a slice of a cached whole source tensor).

    ``torch.save`` writes a view's whole storage: kept as is, rank ``r``'s file would carry every TP rank's rows of
    a dim-0-split tensor, and the rank being built would pin the whole source tensors, breaking the one-rank bound.
    """
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


def _rank_parts(conv: Conversion) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """``{(tp, pp): [(tensor index, part index), ...]}``: what each target rank holds, in plan order.

    The plan is tensor-major (one logical tensor, its TP boxes, the ranks of each); NxD's files are rank-major, so
    the plan is inverted once (indices only, no data) to build one rank at a time.
    """
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, t in enumerate(conv.tensors):
        for j, ranks in enumerate(t.ranks):
            for rank in ranks:
                out.setdefault(rank, []).append((i, j))
    return out


def _build_rank(
    conv: Conversion, parts: list[tuple[int, int]], cache: TensorCache
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Model shard and named optimizer (``NxdTag`` form) of one target rank, produced from the plan."""
    model: dict[str, torch.Tensor] = {}
    o: dict[str, Any] | None = None
    for i, j in parts:
        out = conv.tensors[i]
        info = out.info
        box, plan = out.parts[j]
        _, data = next(iter(conv.produce(type(out)(info, ((box, plan),), None, ()), cache)))
        data = _owned(data)
        if info.role == "optimizer_state":
            if o is None:
                o = {"state": {}, "param_groups": [], "master_weights": None, "extra": {}}
            if info.key == "master_weight":
                o["master_weights"] = o["master_weights"] or {}
                o["master_weights"][info.param] = data
            else:
                o["state"].setdefault(info.param, {})[info.key] = data
        else:
            model[info.name] = data
    opt = conv.trees.optimizer
    if o is not None and opt is not None:
        names = set(model)
        for p, per in opt.get("state", {}).items():
            if p in names:
                o["state"].setdefault(p, {}).update({k: treecodec.decode(v) for k, v in per.items()})
        o["param_groups"] = [
            {
                **{k: treecodec.decode(v) for k, v in g.items() if k != "params"},
                "params": [p for p in g["params"] if p in names],
            }
            for g in opt.get("param_groups", [])
        ]
        # ZeRO-1 pid order = the rank's model order
        order = [n for n in model if n in o["state"]]
        o["state"] = {n: o["state"][n] for n in order}
    return model, o


class NxdExport:
    """An NxD tag as units for :mod:`~converters.parallel`: one unit = one (tp, pp) rank (its model file and its
    optimizer file(s), ZeRO-1 shards included).

    NxD stores one ``torch.save`` file per rank, so a rank is the smallest unit one writer can own, and ranks are
    independent.  The coordinator's :class:`~ckpt.converters.nxd.writer.TagWriter` makes the temp tag folder
    (``checkpoint`` marker, ``model/``); workers add their ranks with writers that *join* it; the coordinator
    writes ``scheduler.pt`` / ``user_content.pt``, renames and writes ``done`` last.  Ranks are produced from the
    plan alone (:func:`_build_rank`), so a rank's files are the same bytes whoever writes it.
    """

    def __init__(self, conv: Conversion, *, xser: bool = False) -> None:
        if conv.to != "neuron" or conv.spec is None:
            raise LayoutError("--format nxd needs --to neuron")
        self.conv = conv
        self.spec = conv.spec
        self.xser = xser
        by_rank = _rank_parts(conv)
        self.ranks = sorted(by_rank)
        self.parts = [by_rank[r] for r in self.ranks]

        def nbytes(i: int, j: int) -> int:
            return conv.tensors[i].parts[j][0].numel * conv.tensors[i].info.dtype.itemsize

        #: bytes each rank writes (replicated tensors on every rank holding them): what the workers balance
        self.weights = [sum(nbytes(i, j) for i, j in parts) for parts in self.parts]
        # progress counts a replicated part on its first rank only, so the ranks add up to ``conv.nbytes``
        self._logical = [
            sum(nbytes(i, j) for i, j in parts if conv.tensors[i].ranks[j][0] == self.ranks[u])
            for u, parts in enumerate(self.parts)
        ]
        self._writer: Any = None

    def _tag_writer(self, dst: Path, join: Path | None = None) -> Any:
        from ckpt.converters.nxd.writer import TagWriter

        spec = self.spec
        return TagWriter(dst.parent, dst.name, xser=self.xser, dp_size=spec.dp, zero1=spec.dp > 1, join=join)

    def begin(self, dst: Path) -> Path:
        check_dst_free(dst)
        if dst.exists():
            dst.rmdir()  # an empty folder (check_dst_free): TagWriter refuses any existing target
        self._writer = self._tag_writer(dst)
        return self._writer.tmp

    def write(
        self,
        tmp: Path,
        units: Sequence[int],
        progress: Callable[[int], None] | None = None,
        *,
        worker: int = 0,
    ) -> UnitReceipt:
        """Build and write ranks ``units`` one at a time into the coordinator's temp tag folder."""
        # the tag's name, for messages: the temp folder is ``.<name>.tmp-<id>`` (TagWriter's naming)
        w = self._tag_writer(tmp.parent / tmp.name[1:].rpartition(".tmp-")[0], join=tmp)
        cache = TensorCache(self.conv.view.read, capacity=3)
        try:
            for u in units:
                tp, pp = self.ranks[u]
                model, optim = _build_rank(self.conv, self.parts[u], cache)
                w.write_rank((tp, pp, 0), model, optim)
                del model, optim
                if progress is not None:
                    progress(self._logical[u])
        finally:
            w.abort()  # a joined writer only stops; the folder is the coordinator's
        return UnitReceipt(worker, tuple(units), [self.ranks[u] for u in units])

    def commit(self, tmp: Path, dst: Path, receipts: list[UnitReceipt]) -> Path:
        """Check every rank's model file is there, then ``scheduler.pt`` / ``user_content.pt``, rename, ``done``."""
        from ckpt.converters.nxd.naming import rank_file_name

        check_cover(receipts, len(self.ranks), str(dst))
        if self._writer is None or self._writer.tmp != tmp:
            raise CkptError(f"{dst}: commit by a writer that did not begin this tag")
        for tp, pp in self.ranks:
            model_file = tmp / "model" / rank_file_name(0, tp, pp, None)
            if not model_file.exists():
                raise CkptError(f"{dst}: rank tp {tp} pp {pp} was not written")
        trees = self.conv.trees
        return self._writer.finish(
            treecodec.decode(trees.scheduler) if trees.scheduler is not None else None,
            treecodec.decode(trees.user) if trees.user is not None else None,
        )

    def abort(self, tmp: Path) -> None:
        if self._writer is not None:
            self._writer.abort()
        remove_dir(tmp)


def write_nxd(conv: Conversion, dst: str | Path, *, xser: bool = False) -> Path:
    """Write ``conv`` (Neuron layout) as an NxD-native tag ``dst``, streaming one (tp, pp) rank at a time.

    NxD keeps one file per rank (plus one optimizer file per DP rank with ZeRO-1), so a rank's model shard and
    optimizer are the smallest unit that can be written: each rank is produced from the plan, handed to
    :class:`~ckpt.converters.nxd.writer.TagWriter` and dropped.  Memory: one rank's state (and its ZeRO-1 shards
    while saved) plus a 3-entry cache of whole source tensors, whatever the model size.  The price is reads: a
    source tensor split over TP is read once per TP rank (the cache holds whole tensors, not one rank's slices).
    One process; ``--workers N`` / torchrun run the same :class:`NxdExport` with the ranks spread over workers.
    """
    return write_serial(NxdExport(conv, xser=xser), dst)


__all__ = ["NxdExport", "NxdTagSource", "is_nxd_dir", "open_nxd", "write_nxd"]
