"""An NxD tag (training checkpoint, NxD converter output, legacy layout) as a Neuron-layout conversion source.

Pieces are read from the rank files as NxD stored them (:class:`~.reader.NxdTagReader`): one (tp, pp) rank's local
tensor, sliced.  Memory streams: every file is memory-mapped (plain rank files whole, xser tensors one file each), so
an open rank costs page cache, not anonymous memory; a ZeRO-1 optimizer tensor is merged over DP when it is read, one
tensor at a time (:class:`~.zero1.Deferred`), never a whole rank's optimizer.  The tag is
described as our manifest would describe it (docs/format.md, "Neuron (NxD) layout"): logical tensors with the
``partition`` of the rule set, PP ranks from the files, and ``extra.nxd`` recording what the files do not say.

Parallel flags the files cannot record come from the caller or are detected (:mod:`.flags`): ``qkv_linear`` /
``fuse_qkv`` from the tensor names; ``kv_size_multiplier`` from the K/V shapes and ``virtual_pp`` from the layer
placement, both only with the model config; ``hw`` only from the caller.  Before anything is planned, every rank file
is checked to hold the same tensors as its TP and EP peers (:mod:`.peers`), and the tag's status: an incomplete tag is
refused, and a training tag whose save never wrote ``done`` (a crashed async save) only with ``allow_unmarked``.  The
optimizer files are described by :mod:`.optim_state`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from ckpt.errors import CkptError, CorruptionError, LayoutError
from ckpt.format import treecodec
from ckpt.format.dtypes import dtype_name
from ckpt.format.manifest import TensorDesc
from ckpt.layouts import LayoutSpec, Piece, bit_equal, plan_nxd_to_full
from ckpt.layouts.families import family_for_rule_set, get_family, rule_set_for_config, rules_with
from ckpt.layouts.names import EXPERT_STACKED, nxd_to_hf_names
from ckpt.layouts.partition import partition_entry
from ckpt.layouts.record import NxdRecord
from ckpt.layouts.rules import check_known

from ..engine import Source, Trees, slice_of
from ..engine.experts import with_expert_views
from .discovery import TagStatus, tag_status
from .flags import SOURCE_FLAGS, detect_flags, detect_virtual_pp
from .naming import RankKey
from .optim_state import MASTER_KEY, describe_optimizer
from .peers import check_ep_ranks, check_tp_peers
from .reader import open_tag
from .zero1 import Deferred

NAME = "nxd"


def detect(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    p = Path(path)
    if "://" in path or not p.is_dir():
        return False
    try:
        from .files import scan_tag

        files = scan_tag(p)
    except CkptError:
        return False
    return bool(files.model or files.legacy)


def check_usable(tag_dir: str | Path, allow_unmarked: bool) -> TagStatus:
    """Refuse an incomplete tag, and a training tag without ``done`` unless ``allow_unmarked`` (with a warning:
    NxD's own auto-resume skips it).  Marker-less NxD converter output is accepted as it is."""
    info = tag_status(tag_dir)
    if info.problems:
        raise CorruptionError(f"{info.path}: {info.status.value} tag: {info.problems[0]}")
    if info.status is TagStatus.UNMARKED and (Path(info.path) / "checkpoint").is_file():
        if not allow_unmarked:
            raise CkptError(
                f"{info.path}: tag has no 'done' marker (a save that crashed before marking it); "
                "pass allow_unmarked=True (--allow-unmarked) to use it"
            )
        warnings.warn(
            f"{info.path}: using an unmarked tag (every file present, no 'done'); NxD's auto-resume would skip it",
            stacklevel=3,
        )
    return info.status


class NxdTagSource(Source):
    """An NxD tag as a Neuron-layout source (see the module docstring)."""

    format = NAME
    layout = "neuron"

    def __init__(
        self,
        path: str | Path,
        *,
        config: Mapping[str, Any] | None = None,
        flags: Mapping[str, Any] | None = None,
        rule_set: str | None = None,
        step: int | None = None,
        param_names: Mapping[RankKey, Sequence[str]] | None = None,
        allow_unmarked: bool = False,
        verify: bool = True,
        replicated: Sequence[str] = (),
    ) -> None:
        given = dict(flags or {})
        unknown = sorted(set(given) - set(SOURCE_FLAGS))
        if unknown:
            raise LayoutError(
                f"{path}: {unknown[0]!r} cannot be set for an NxD tag (known: {', '.join(SOURCE_FLAGS)})"
            )
        self.path = str(path)
        self.config = dict(config) if config is not None else None
        status = check_usable(path, allow_unmarked)
        rule_set = rule_set or rule_set_for_config(self.config)  # default: the config's model family
        self.r = open_tag(path, param_names=param_names, verify=verify, mmap=True, rule_set=rule_set)
        meta = self.r.meta
        self.r.check_complete()
        tp, pp, ep = meta.tp_size, meta.pp_size, meta.ep_size
        self._ep = ep
        per_rank = {(t, p): self.r.model_metas((t, p, 0)) for t in range(tp) for p in range(pp)}
        check_tp_peers(per_rank, self.path)
        self._pp_of: dict[str, list[int]] = {}
        local: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for p in range(pp):
            for name, shape, dt in per_rank[(0, p)]:
                self._pp_of.setdefault(name, []).append(p)
                local.setdefault(name, (shape, dt))
        names = list(local)
        shapes = {n: s for n, (s, _) in local.items()}
        detected = detect_flags(names, shapes, self.config, tp, given)
        replicated = tuple(replicated)
        family = family_for_rule_set(rule_set)
        self._stacked = (
            frozenset(n for n in names if EXPERT_STACKED.match(n))
            if family.experts is not None
            else frozenset()
        )
        if ep > 1 and not self._stacked:
            if self.config and self.config.get("model_type"):
                get_family(
                    str(self.config["model_type"])
                )  # an unknown family: refused with the supported ones
            raise LayoutError(
                f"{self.path}: rank files carry ep_rank (ep={ep}) but no NxD expert tensors "
                f"(rule set {rule_set}); expert parallelism needs an MoE model: pass its --config"
            )
        if ep > 1:
            check_ep_ranks(self.r, per_rank, ep, self._stacked, self.path)
        check_known(
            (
                h
                for n in names
                if family.experts is None or not EXPERT_STACKED.match(n)
                for h in nxd_to_hf_names(n, family)
            ),
            rules_with(rule_set, replicated),
            rule_set,
        )
        record = NxdRecord(rule_set=rule_set, config=self.config, replicated=replicated, **detected)
        if self.config:  # the model the tag holds must be one the rule set covers (model type, dims, flags)
            self._with_ep(record.spec(tp=tp, pp=pp, dp=meta.dp_size, where=self.path))
        if self.config and pp > 1 and "virtual_pp" not in given:
            record = detect_virtual_pp(
                record, self._pp_of, self.config, tp=tp, pp=pp, dp=meta.dp_size, where=self.path
            )
        self.zero1 = meta.zero1
        self.tensors = {}
        for name, (shape, dt) in local.items():
            part = partition_entry(name, tp, rule_set, replicated)
            full = list(shape)
            if part is not None:
                full[int(part["dim"])] *= tp
            if name in self._stacked and ep > 1:  # EP rank k holds experts [k*E/ep, (k+1)*E/ep) (experts.py)
                full[0] *= ep
                assert part is not None
                part = {**part, "ep": ep}
            self.tensors[name] = TensorDesc(name, "parameter", tuple(full), dtype_name(dt), partition=part)
        self._models: OrderedDict[RankKey, dict[str, torch.Tensor]] = OrderedDict()
        self._optims: OrderedDict[RankKey, dict[str, Any] | None] = OrderedDict()
        self._loaded: OrderedDict[tuple[RankKey, str], torch.Tensor] = OrderedDict()
        optimizer, opt_extra = describe_optimizer(
            (self._optim((0, p, 0)) for p in range(pp)), self.tensors, zero1=meta.zero1, where=self.path
        )
        record_kw: dict[str, Any] = {
            "pp_ranks": dict(self._pp_of) if pp > 1 else None,
            "source": {
                "format": "nxd",
                "tag": meta.name,
                "status": status.value,
                "xser": meta.xser,
                "zero1": meta.zero1,
                "legacy": meta.legacy,
            },  # fmt: skip
            "optimizer_extra": opt_extra or None,
        }
        self.record = dataclasses.replace(record, **record_kw)
        self.flags = dataclasses.replace(self.record.flags(tp=tp, pp=pp, dp=meta.dp_size), ep=ep)
        user = self.r.user_content()
        sched = self.r.scheduler()
        if step is None:
            step = meta.step
            if step is None and isinstance(user, dict) and isinstance(user.get("total_steps"), int):
                step = user["total_steps"]
        self.step_recorded = (
            step is not None
        )  # no file names one: unknown (the placeholder 0 is never shown as it)
        step = int(step or 0)
        self.trees = Trees(
            step=step,
            optimizer=optimizer,
            scheduler=treecodec.encode(sched, "scheduler.pt") if sched is not None else None,
            progress={"step": step},
            user=treecodec.encode(user, "user_content.pt") if user is not None else None,
            extra={"nxd": self.record.to_extra()},
            world_size=tp * pp * meta.dp_size,
        )
        # with a config, every rank tensor must be what the config and flags imply (metadata only, no data read)
        if self.config:
            spec = self.spec()
            plan_nxd_to_full(spec, with_expert_views(self, spec).rank_metas())

    def _with_ep(self, spec: LayoutSpec) -> LayoutSpec:
        return dataclasses.replace(spec, ep=self._ep) if self._ep > 1 else spec

    def spec(self, config: Mapping[str, Any] | None = None) -> LayoutSpec:
        """The tag's layout with its EP degree (the record knows no EP; the file names do)."""
        return self._with_ep(super().spec(config))

    def pp_ranks(self, name: str) -> tuple[int, ...]:
        return tuple(self._pp_of[name])

    def _model(self, rank: RankKey) -> dict[str, torch.Tensor]:
        d = self._models.get(rank)
        if d is None:
            d = self._models[rank] = self.r.model(rank)
            while len(self._models) > self.r.meta.tp_size * self._ep:
                self._models.popitem(last=False)
        else:
            self._models.move_to_end(rank)
        return d

    def _optim(self, rank: RankKey) -> dict[str, Any] | None:
        if rank not in self._optims:
            self._optims[rank] = self.r.optimizer(rank, lazy=True)
            while len(self._optims) > self.r.meta.tp_size * self._ep:
                self._optims.popitem(last=False)
        else:
            self._optims.move_to_end(rank)
        return self._optims[rank]

    def _stored(self, rank: RankKey, desc: TensorDesc) -> torch.Tensor:
        """The tensor ``desc`` names as rank ``(tp, pp, ep)`` stores it (a ZeRO-1 state merged over DP)."""
        if desc.role == "optimizer_state":
            opt = self._optim(rank)
            if opt is None:
                raise CorruptionError(f"{self.path}: no optimizer for tp {rank[0]} pp {rank[1]} ep {rank[2]}")
            if desc.key == MASTER_KEY:
                t = (opt.get("master_weights") or {})[desc.param]
            else:
                t = opt["state"][desc.param][desc.key]
        else:
            t = self._model(rank)[desc.name]
        if isinstance(t, Deferred):
            t = self._merged(rank, desc.name, t)
        return t

    def read(self, piece: Piece) -> torch.Tensor:
        assert piece.rank is not None
        desc = self.tensors[piece.name]
        param = desc.param if desc.role == "optimizer_state" else piece.name
        if param in self._stacked and self._ep > 1:
            return self._expert_piece(piece, desc)
        out = slice_of(self._stored((*piece.rank, 0), desc), piece)
        if self._ep > 1 and not (desc.role == "optimizer_state" and self.zero1):
            # every EP rank stores its own copy (ZeRO-1 states come from the same DP files for all): compared, as
            # replicated TP copies are, so a desynchronised EP rank is refused rather than silently dropped
            for k in range(1, self._ep):
                if not bit_equal(slice_of(self._stored((*piece.rank, k), desc), piece), out):
                    raise LayoutError(
                        f"{self.path}: {piece.name} of tp {piece.rank[0]} pp {piece.rank[1]} ep {k} differs from its "
                        "copy on ep 0; copies of non-expert tensors must be identical on every EP rank"
                    )
        return out

    def _expert_piece(self, piece: Piece, desc: TensorDesc) -> torch.Tensor:
        """A piece of a stacked expert tensor (or of its moment), whose dim 0 (experts) is spread over the EP ranks'
        files: a view when it lies in one EP rank (what the converter reads: one expert slot), else the EP ranks'
        blocks concatenated."""
        assert piece.rank is not None
        blocks = [self._stored((*piece.rank, k), desc) for k in range(self._ep)]
        per = blocks[0].shape[0]
        if piece.dim == 0 and piece.length > 0:
            k0, k1 = piece.start // per, (piece.start + piece.length - 1) // per
            if k0 == k1:
                return blocks[k0].narrow(0, piece.start - k0 * per, piece.length)
        return slice_of(torch.cat(blocks, 0), piece)

    def read_anon(self, piece: Piece) -> int:
        """Model tensors and plain optimizer states are views of memory-mapped files (a legacy non-zip file is read
        whole); a ZeRO-1 state is merged over DP into one new rank-local tensor."""
        desc = self.tensors[piece.name]
        if desc.role == "optimizer_state" and self.zero1:
            return self.stored_bytes(piece)
        return self.stored_bytes(piece) if self.r.meta.legacy else 0

    def cache_bytes(self, pieces: Iterable[Piece]) -> int:
        """The two merged ZeRO-1 tensors :meth:`_merged` keeps."""
        if not self.zero1:
            return 0
        merged = (self.stored_bytes(p) for p in pieces if self.tensors[p.name].role == "optimizer_state")
        return 2 * max(merged, default=0)

    def _merged(self, rank: RankKey, name: str, d: Deferred) -> torch.Tensor:
        """A ZeRO-1 tensor merged over DP, kept while the next pieces of it are read (a rank tensor split into
        several target tensors, e.g. ``gate_up_proj``) and dropped two tensors later."""
        key = (rank, name)
        t = self._loaded.get(key)
        if t is None:
            t = self._loaded[key] = d.load()
            while len(self._loaded) > 2 * self._ep:
                self._loaded.popitem(last=False)
        return t

    def close(self) -> None:
        self._models.clear()
        self._optims.clear()
        self._loaded.clear()


#: the conversion engine's options an NxD tag source takes as they are (``source_flags`` it takes as ``flags``)
TAG_OPTIONS = ("config", "step", "allow_unmarked", "verify", "param_names", "replicated")

S = TypeVar("S", bound=NxdTagSource)


def tag_source(cls: type[S], path: str, options: Mapping[str, Any], *extra: str) -> S:
    """``cls(path, ...)``, a source over an NxD tag (:class:`NxdTagSource` or a format's subclass of it), from the
    conversion engine's ``open_source`` options: ``source_flags`` become the tag's ``flags``, ``extra`` names the
    further options ``cls`` takes, and the others (``storage_options``, another format's) are not the tag's."""
    kw = {k: options[k] for k in (*TAG_OPTIONS, *extra) if k in options}
    return cls(path, flags=options.get("source_flags"), **kw)


def open_source(path: str, **options: Any) -> NxdTagSource:
    return tag_source(NxdTagSource, path, options)


__all__ = ["NxdTagSource", "check_usable", "detect", "open_source", "tag_source"]
