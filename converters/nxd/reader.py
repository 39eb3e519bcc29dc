"""Read one NxD tag (training checkpoint, converter output or legacy layout) into plain tensors, without torch_xla.

The result keeps NxD's tensor-parallel layout: one ``{name: tensor}`` per (tp, pp, ep) rank exactly as NxD stored
it (TP shards are not merged here; the layout engine does that).  ZeRO-1 optimizer shards *are* merged over DP, so
each rank's optimizer is keyed by parameter name like its model shard.

:class:`NxdTagReader` loads one rank at a time (bounded memory for converters); :func:`read_tag` loads everything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CkptError, CorruptionError
from ckpt.layouts.names import EXPERT_STACKED
from ckpt.layouts.nxd_order import nxd_param_order
from ckpt.layouts.rules import DEFAULT_RULE_SET
from ckpt.safe_unpickle import TensorReference, load_torch_file

from . import zero1_ep
from .discovery import TagStatus, tag_status
from .files import TagFiles, missing_rank_files, scan_tag
from .naming import RankKey
from .step import tag_step
from .xser import can_mmap, load_checked, load_nxd_file, read_info, tensors_dir
from .zero1 import (
    is_zero1_dict,
    merge_plain_optimizer,
    merge_zero1_optimizer,
    plain_optimizer_shapes,
    resolve_param_names,
)

Shape = tuple[int, ...]


@dataclass(frozen=True)
class NxdTagMeta:
    """What the file names and markers say about a tag."""

    path: Path
    name: str
    step: int | None
    status: TagStatus
    tp_size: int
    pp_size: int
    dp_size: int  # optimizer DP shards (ZeRO-1); 1 otherwise
    ep_size: int
    xser: bool
    zero1: bool
    legacy: bool
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class NxdTag:
    """A whole tag in memory.

    ``per_rank_optimizer[rank]`` is ``{"state": {name: {key: tensor}}, "param_groups": [{..., "params": [names]}],
    "master_weights": {name: tensor} | None, "extra": {other top-level keys}}``.
    """

    meta: NxdTagMeta
    per_rank_model: dict[RankKey, dict[str, torch.Tensor]]
    per_rank_optimizer: dict[RankKey, dict[str, Any]]
    scheduler: dict[str, Any] | None
    user_content: Any


def _flat_tensor_dict(obj: Any, where: Path) -> dict[str, torch.Tensor]:
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]  # legacy files often wrap the state dict
    if not (isinstance(obj, dict) and all(isinstance(k, str) for k in obj)):
        raise CorruptionError(
            f"{where}: expected a {{name: tensor}} model state dict, got {type(obj).__name__}"
        )
    return obj


class NxdTagReader:
    """Lazy access to one tag: nothing but file names is read until a rank is asked for.

    Args:
        path: the tag directory (or the converter's ``model/`` folder, or a legacy directory).
        param_names: optional explicit pid order per rank (names, index = pid), for optimizers whose files record no
            ``param_names`` and whose grouping is neither a single group nor NxD's weight-decay split (or whose
            layout's NxD parameter order ckpt does not know); checked against the files' own ``param_names``.
        rule_set: the layout's rule set (the model family), which says NxD's parameter order
            (:mod:`ckpt.layouts.nxd_order`) used to name the pids of files that record no ``param_names``.
        mmap: memory-map plain files instead of reading them.
        verify: check the zip CRC32 of every member of each ``torch.save`` file before its tensors are loaded
            (:meth:`model`, :meth:`optimizer`, :meth:`scheduler`, :meth:`user_content`; plain files and each xser
            ``tensor_<tid>.pt``) and raise :class:`CorruptionError` naming the file, rank and (xser) tensor.  Costs
            one extra sequential read of each file, normally from the page cache.  Files that are not zips (legacy
            ``torch.save`` pickles) have no CRC and are accepted unchecked.  Off: trust the bytes as torch.load does.

    :meth:`read` (``read_tag``) refuses a tag whose grid has a gap (a rank file missing below the highest rank some
    file names; see :func:`~.files.missing_rank_files` for what cannot be inferred).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        param_names: Mapping[RankKey, Sequence[str]] | None = None,
        mmap: bool = False,
        verify: bool = True,
        rule_set: str | None = DEFAULT_RULE_SET,
    ) -> None:
        self.files: TagFiles = scan_tag(path)
        self._param_names = param_names or {}
        self._rule_set = rule_set
        self._mmap = mmap
        self._verify = verify
        f = self.files
        zero1 = f.dp_size > 1 or (bool(f.optim) and self._peek_zero1())
        info = tag_status(f.path)
        self.meta = NxdTagMeta(
            path=f.path,
            name=f.path.name,
            step=tag_step(f, verify=verify),
            status=info.status,
            tp_size=f.tp_size,
            pp_size=f.pp_size,
            dp_size=f.dp_size,
            ep_size=f.ep_size,
            xser=f.xser,
            zero1=zero1,
            legacy=f.is_legacy,
            problems=info.problems,
        )

    def _peek_zero1(self) -> bool:
        first = self.files.optim[min(self.files.optim)]
        return is_zero1_dict(load_torch_file(first, mmap=can_mmap(first)))

    @property
    def ranks(self) -> list[RankKey]:
        """The (tp, pp, ep) ranks of the model shards present (see :meth:`missing` for absent ones)."""
        return self.files.ranks

    def missing(self) -> list[str]:
        """Rank files the tag's grid expects but that are absent (one line each; empty when none is)."""
        return missing_rank_files(self.files)

    def check_complete(self) -> None:
        """Raise :class:`CorruptionError` naming the first absent rank file, if any."""
        gone = self.missing()
        if gone:
            more = f" (and {len(gone) - 1} more)" if len(gone) > 1 else ""
            raise CorruptionError(f"{self.files.path}: {gone[0]}{more}")

    @staticmethod
    def _where(kind: str, rank: RankKey) -> str:
        return f"{kind} of tp {rank[0]} pp {rank[1]} ep {rank[2]}"

    def _model_path(self, rank: RankKey) -> Path:
        table = self.files.legacy if self.meta.legacy else self.files.model
        if rank not in table:
            raise CkptError(f"{self.files.path}: no model file for tp {rank[0]} pp {rank[1]} ep {rank[2]}")
        return table[rank]

    def _is_xser_file(self, p: Path) -> bool:
        return tensors_dir(p).is_dir() if self.meta.legacy else self.meta.xser

    def model_shapes(self, rank: RankKey) -> list[tuple[str, Shape]]:
        """(name, shape) of each tensor of a model shard, in stored order; cheap for xser files with ``.info.pt``."""
        p = self._model_path(rank)
        if self._is_xser_file(p):
            info = read_info(p)
            refs = _flat_tensor_dict(load_torch_file(p), p)
            if info is not None and all(isinstance(r, TensorReference) for r in refs.values()):
                return [(k, tuple(int(s) for s in info[r.tid]["shape"])) for k, r in refs.items()]
        return [(k, tuple(v.shape)) for k, v in self.model(rank).items()]

    def model_metas(self, rank: RankKey) -> list[tuple[str, Shape, torch.dtype]]:
        """(name, shape, dtype) of each tensor of a model shard, in stored order; from ``.info.pt`` for xser files
        that have it, else from the file (memory-mapped when the reader is)."""
        p = self._model_path(rank)
        if self._is_xser_file(p):
            info = read_info(p)
            refs = _flat_tensor_dict(load_torch_file(p), p)
            if info is not None and all(isinstance(r, TensorReference) for r in refs.values()):
                return [
                    (k, tuple(int(s) for s in info[r.tid]["shape"]), info[r.tid]["dtype"])
                    for k, r in refs.items()
                ]
        return [(k, tuple(v.shape), v.dtype) for k, v in self.model(rank).items()]

    def model(self, rank: RankKey) -> dict[str, torch.Tensor]:
        """The model shard of one rank, as NxD stored it.

        When NxD left the model tensors out (``avoid_saving_lower_precision_weights``), they are rebuilt from the
        ZeRO-1 master weights cast to the dtype recorded in ``.info.pt`` (what NxD's own load does).
        """
        p = self._model_path(rank)
        xser = self._is_xser_file(p)
        missing = None
        if xser and self.files.optim and not self.meta.legacy:
            refs = load_torch_file(p)
            tid_name = {r.tid: k for k, r in refs.items() if isinstance(r, TensorReference)}
            info = read_info(p, verify=self._verify)
            opened: list[dict[str, Any] | None] = []

            def missing(ref: TensorReference) -> torch.Tensor:
                if not opened:  # the DP files are opened once, each master weight merged when it is needed
                    opened.append(self.optimizer(rank, lazy=True))
                master = (opened[0] or {}).get("master_weights") or {}
                name = tid_name.get(ref.tid)
                if name not in master or info is None:
                    raise CorruptionError(
                        f"{p}.tensors/tensor_{ref.tid}.pt: missing and no master weight for {name}"
                    )
                return master[name].load().to(info[ref.tid]["dtype"])

        loaded = load_nxd_file(
            p, xser, mmap=self._mmap, missing=missing, verify=self._verify, context=self._where("model", rank)
        )
        return _flat_tensor_dict(loaded, p)

    def param_names(self, rank: RankKey) -> list[str] | None:
        """Name of each optimizer pid of this rank (index = pid); None without optimizer files."""
        opt0 = self._optim_files(rank)
        if not opt0:
            return None
        explicit = self._param_names.get(rank)
        # names and shapes need no tensor data: xser ref files hold none, plain ones are memory-mapped
        d0 = load_torch_file(opt0[0], mmap=not self.meta.xser and can_mmap(opt0[0]))
        where = str(opt0[0])

        def order(names: Sequence[str]) -> list[str] | None:
            return nxd_param_order(names, self._rule_set, pp=self.meta.pp_size)

        if is_zero1_dict(d0):
            return resolve_param_names(
                self.model_shapes(rank), d0["param_groups"], d0["shape_info"], where=where, explicit=explicit,
                order=order,
            )  # fmt: skip
        d0 = load_nxd_file(opt0[0], self.meta.xser, mmap=True)
        shapes, n = plain_optimizer_shapes(d0)
        return resolve_param_names(
            self.model_shapes(rank), d0["param_groups"], shapes, where=where, num_params=n, explicit=explicit,
            order=order,
        )  # fmt: skip

    def _optim_files(self, rank: RankKey) -> list[Path]:
        optim = self.files.optim
        key = rank if (0, rank) in optim else (rank[0], rank[1], 0)  # ZeRO-1 optim names carry no ep
        files = [optim[(dp, key)] for dp in range(self.meta.dp_size) if (dp, key) in optim]
        if files and len(files) != self.meta.dp_size:
            raise CorruptionError(
                f"{self.files.path}/optim: {len(files)} of {self.meta.dp_size} DP shards for {key}"
            )
        return files

    def optimizer(self, rank: RankKey, *, lazy: bool = False) -> dict[str, Any] | None:
        """This rank's optimizer state with ZeRO-1 shards merged over DP and pids replaced by names; None if absent.

        ``lazy``: the DP files are memory-mapped (whatever the reader's ``mmap``) and every ZeRO-1 state or master
        weight is a :class:`~.zero1.Deferred`, merged when loaded, so holding the result costs no tensor memory;
        plain optimizer tensors are memory-mapped views.  Same structure and values as the eager result.
        """
        files = self._optim_files(rank)
        if not files:
            return None
        if self.meta.zero1 and self.meta.ep_size > 1:  # NeuronEPZero1Optimizer: the files span the EP ranks
            return self._ep_zero1_optimizer(rank, files, lazy)
        names = self.param_names(rank)
        assert names is not None
        dicts = [
            load_nxd_file(
                f,
                self.meta.xser,
                mmap=self._mmap or lazy,
                verify=self._verify,
                context=self._where(f"optimizer dp {dp}", rank),
            )
            for dp, f in enumerate(files)
        ]
        where = str(files[0])
        if is_zero1_dict(dicts[0]):
            return merge_zero1_optimizer(dicts, names, where=where, lazy=lazy)
        return merge_plain_optimizer(dicts[0], names, where=where)

    def _ep_zero1_optimizer(self, rank: RankKey, files: list[Path], lazy: bool) -> dict[str, Any]:
        """The named optimizer of EP rank ``rank[2]`` from every DP rank's file of its (tp, pp) (:mod:`.zero1_ep`)."""
        dicts = [
            load_nxd_file(
                f, self.meta.xser, mmap=self._mmap or lazy, verify=self._verify,
                context=self._where(f"optimizer dp {dp}", rank),
            )
            for dp, f in enumerate(files)
        ]  # fmt: skip
        where = str(files[0])
        if not zero1_ep.is_ep_zero1_dict(dicts[0]):
            raise CorruptionError(
                f"{where}: ZeRO-1 optimizer of a tag with ep_rank files lacks NeuronEPZero1Optimizer's ep_*_offset keys"
            )
        return zero1_ep.merge(
            dicts, self.meta.ep_size, rank[2], self.model_shapes(rank), lambda n: bool(EXPERT_STACKED.match(n)),
            where=where, lazy=lazy,
        )  # fmt: skip

    def scheduler(self) -> dict[str, Any] | None:
        f = self.files.scheduler
        return None if f is None else load_checked(f, verify=self._verify)

    def user_content(self) -> Any:
        f = self.files.user_content
        return None if f is None else load_checked(f, verify=self._verify)

    def read(self) -> NxdTag:
        """Everything at once (memory = the whole tag); refuses a tag with a missing rank file."""
        self.check_complete()
        return NxdTag(
            meta=self.meta,
            per_rank_model={r: self.model(r) for r in self.ranks},
            per_rank_optimizer={r: o for r in self.ranks if (o := self.optimizer(r)) is not None},
            scheduler=self.scheduler(),
            user_content=self.user_content(),
        )


def open_tag(
    path: str | Path,
    *,
    param_names: Mapping[RankKey, Sequence[str]] | None = None,
    mmap: bool = False,
    verify: bool = True,
    rule_set: str | None = DEFAULT_RULE_SET,
) -> NxdTagReader:
    """A lazy reader for one tag (see :class:`NxdTagReader`; ``verify`` checks zip CRC32s on load)."""
    return NxdTagReader(path, param_names=param_names, mmap=mmap, verify=verify, rule_set=rule_set)


def read_tag(
    path: str | Path,
    *,
    param_names: Mapping[RankKey, Sequence[str]] | None = None,
    verify: bool = True,
    rule_set: str | None = DEFAULT_RULE_SET,
) -> NxdTag:
    """Read a whole tag into memory (see :class:`NxdTag`).

    Raises :class:`CorruptionError` for a missing rank file (a gap in the grid the file names imply) and, with
    ``verify`` (default), for a file whose zip CRC32s do not match its bytes (legacy non-zip files are not checked).
    """
    return NxdTagReader(path, param_names=param_names, verify=verify, rule_set=rule_set).read()
