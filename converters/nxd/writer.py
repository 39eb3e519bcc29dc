"""Write an :class:`~converters.nxd.reader.NxdTag` as an NxD-native tag that NxD's ``load_checkpoint`` loads.

Same names and structure as ``neuronx_distributed.trainer.save_checkpoint`` (verified byte-for-byte on the pickled
structure of the fixtures): ``checkpoint`` marker, ``model/dp_rank_00[_ep_rank_EE]_tp_rank_TT_pp_rank_PP.pt``,
``optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt`` (ZeRO-1 re-sharded for the requested DP size, padding and master
weights included), ``scheduler.pt``, ``user_content.pt``, and ``done`` last.  xser writes ``X.pt`` (refs),
``X.pt.tensors/tensor_<tid>.pt`` and ``X.pt.info.pt``.

Streaming: :class:`TagWriter` takes the tag one (tp, pp, ep) rank at a time (model shard + optimizer), so a
producer that builds ranks one by one (``ckpt convert --format nxd``) holds one rank's state, never the whole tag;
:func:`write_tag` is a loop over it for a tag already in memory.

Atomicity comes from the storage layer's folder transaction (:func:`ckpt.storage.folder.begin_folder`): on disk
the tag is built in a hidden folder next to the target and renamed into place with ``done`` already in it; on an
object store the files go under the tag's prefix and ``done`` is written last.  A crash leaves nothing, a hidden
temp folder, or (object stores) files without ``done``, which NxD does not load: never a ``done`` over partial files.
"""

from __future__ import annotations

import gc
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CheckpointExistsError, CkptError
from ckpt.layouts.names import EXPERT_STACKED
from ckpt.layouts.zero1 import Empty
from ckpt.storage import Storage, open_storage
from ckpt.storage.folder import FolderTxn, begin_folder

from . import zero1_ep
from .naming import RankKey, rank_file_name
from .reader import NxdTag
from .xser import save_nxd_file
from .zero1 import shard_zero1_optimizer, unshard_plain_optimizer


class TagWriter:
    """Write an NxD-native tag one (tp, pp, ep) rank at a time, so memory holds one rank's state, not the tag.

    NxD stores one ``torch.save`` file per rank (and, with ZeRO-1, one optimizer file per DP rank of it), so a rank's
    model shard plus its optimizer is the smallest unit that can be written; the caller builds each rank, hands it to
    :meth:`write_rank` and drops it.  ``checkpoint`` is written first, rank files as they come, ``scheduler.pt`` /
    ``user_content.pt`` and ``done`` in :meth:`finish`, which publishes the tag.  Any exception inside
    ``with TagWriter(...)`` (or :meth:`abort`) removes what was written: nothing partial is ever published.

    Args:
        dst: the tag's path or URL, e.g. ``ckpts/step_1000`` (its parent is created if needed).
        xser: write the xser form (``use_xser=True``) instead of plain ``torch.save`` files.
        dp_size: the DP size ZeRO-1 optimizers are sharded for.
        zero1: write ZeRO-1 optimizer dicts; otherwise plain torch.optim dicts.
        ep_size: expert-parallel size (file names carry an ep field iff it is > 1).
        expert_tensors: names of the model tensors that are each EP rank's own (NxD's stacked experts); with xser
            and ``ep_size > 1`` only ``ep_rank_00`` keeps the other tensors' files, as NxD writes them.
        overwrite: replace an existing local tag at :meth:`finish` (the old one is kept until the new one is in).
        join: the :attr:`url` of another ``TagWriter`` for the same tag, made by a coordinator: this writer only adds
            rank files to it (parallel writers, one process or torchrun rank each, writing disjoint ranks).  It never
            publishes or removes anything: :meth:`finish` is refused and :meth:`abort` only stops it.
    """

    def __init__(
        self,
        dst: str | Path,
        *,
        xser: bool = False,
        dp_size: int = 1,
        zero1: bool = True,
        ep_size: int = 1,
        overwrite: bool = False,
        storage_options: dict[str, Any] | None = None,
        join: str | None = None,
        expert_tensors: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        if dp_size < 1:
            raise CkptError(f"dp_size must be >= 1, got {dp_size}")
        self.dst = str(dst)
        self.xser = xser
        self.dp_size = dp_size
        self.zero1 = zero1
        self.ep_size = ep_size
        self.expert_tensors = frozenset(expert_tensors)
        #: largest number of tensor bytes (distinct storages) one :meth:`write_rank` call was handed: the state a
        #: streaming producer holds at once, reported so callers and tests can check the bound
        self.max_rank_bytes = 0
        self._written: set[RankKey] = set()
        self._txn: FolderTxn | None = None
        self._replaced: str | None = None
        self._open = True
        if join is not None:
            self.storage: Storage = open_storage(join, storage_options)
            if not self.storage.exists("checkpoint"):
                raise CkptError(f"{join}: not the staging folder of a tag being written")
            return
        self._move_aside(overwrite, storage_options)
        try:
            self._txn = begin_folder(self.dst, storage_options)
        except BaseException:
            self._restore_aside()
            raise
        self.storage = self._txn.storage
        try:
            self.storage.put_bytes("checkpoint", b"1")
        except BaseException:
            self.abort()
            raise

    @property
    def url(self) -> str:
        """Where the tag's files are written until :meth:`finish` (what joined writers are given)."""
        return self.storage.url

    def _move_aside(self, overwrite: bool, storage_options: dict[str, Any] | None) -> None:
        local = open_storage(self.dst, storage_options).local_path()
        exists = (
            local is not None and os.path.lexists(local) and (not os.path.isdir(local) or os.listdir(local))
        )
        if not exists:
            return
        if not overwrite:
            raise CheckpointExistsError(f"{self.dst}: already exists (pass overwrite=True to replace it)")
        assert local is not None
        self._replaced = os.path.join(
            os.path.dirname(local), f".{os.path.basename(local)}.replaced-{uuid.uuid4().hex[:8]}"
        )
        os.rename(local, self._replaced)

    def _restore_aside(self) -> None:
        if self._replaced is not None:
            local = open_storage(self.dst).local_path()
            assert local is not None
            if not os.path.lexists(local):
                os.rename(self._replaced, local)
            self._replaced = None

    def __enter__(self) -> TagWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None:
            self.abort()

    def _check_open(self) -> None:
        if not self._open:
            raise CkptError(f"{self.dst}: tag writer already finished or aborted")

    def write_rank(
        self,
        rank: RankKey,
        model: Mapping[str, torch.Tensor] | None,
        optimizer: Mapping[str, Any] | None = None,
        *,
        empty: Empty | None = None,
    ) -> None:
        """Write rank ``(tp, pp, ep)``: its model file and, when given, its optimizer file(s).

        ``model`` is the rank's TP-local state dict in NxD order; ``optimizer`` is the named form of
        :class:`NxdTag` (``state``/``param_groups``/``master_weights``/``extra``), re-sharded here for ZeRO-1 with
        shapes from ``model`` (the shards allocated with ``empty`` when given: file-backed memory from
        :class:`~.scratch.Scratch`).  Once this returns the caller may drop both: nothing is kept.
        """
        self._check_open()
        if rank in self._written:
            raise CkptError(f"{self.dst}: rank {rank} written twice")
        tp, pp, ep = rank
        self.max_rank_bytes = max(self.max_rank_bytes, _state_bytes((model, optimizer)))
        try:
            if model is not None:
                fname = rank_file_name(0, tp, pp, ep if self.ep_size > 1 else None)
                own = frozenset(id(t) for n, t in model.items() if n in self.expert_tensors)
                save_nxd_file(
                    dict(model), self.storage, f"model/{fname}", self.xser,
                    expert=own if self.ep_size > 1 else frozenset(), shared_elsewhere=self.ep_size > 1 and ep > 0,
                )  # fmt: skip
            if optimizer is not None:
                if self.zero1:
                    where = f"{self.dst}/optim tp {tp} pp {pp} ep {ep}"
                    shapes = {k: tuple(v.shape) for k, v in (model or {}).items()}
                    if self.ep_size > 1:  # NeuronEPZero1Optimizer: this EP rank's DP files (zero1_ep.py)
                        dicts = zero1_ep.shard(
                            optimizer, shapes, self.dp_size, self.ep_size, ep, self.expert_tensors.__contains__,
                            where=where, empty=empty,
                        )  # fmt: skip
                    else:
                        dicts = dict(
                            enumerate(
                                shard_zero1_optimizer(
                                    optimizer, shapes, self.dp_size, where=where, empty=empty
                                )
                            )
                        )
                    for r, d in dicts.items():
                        save_nxd_file(d, self.storage, f"optim/{rank_file_name(r, tp, pp)}", self.xser)
                else:
                    fname = rank_file_name(0, tp, pp, ep if self.ep_size > 1 else None)
                    save_nxd_file(
                        unshard_plain_optimizer(optimizer), self.storage, f"optim/{fname}", self.xser
                    )
        except BaseException:
            self.abort()
            raise
        finally:
            # torch.save leaves a reference cycle (its per-call pickler class and the closure over the storages it
            # wrote) that keeps every saved storage alive until the cyclic GC happens to run: without this, ranks
            # (and their ZeRO-1 shard copies) pile up and memory grows with the model after all.
            gc.collect()
        self._written.add(rank)

    def finish(self, scheduler: Any = None, user_content: Any = None) -> Path:
        """Write ``scheduler.pt`` / ``user_content.pt`` (when not None) and publish the tag with ``done``."""
        self._check_open()
        if self._txn is None:
            raise CkptError(f"{self.dst}: a joined tag writer cannot finish; the coordinator's writer does")
        try:
            if scheduler is not None:
                save_nxd_file(scheduler, self.storage, "scheduler.pt", False)
            if user_content is not None:
                save_nxd_file(user_content, self.storage, "user_content.pt", False)
            self._txn.commit({"done": b"1"})
        except BaseException:
            self.abort()
            raise
        self._open = False
        if self._replaced is not None:
            shutil.rmtree(self._replaced, ignore_errors=True)
            self._replaced = None
        return Path(self.dst)

    def abort(self) -> None:
        """Remove what was written (idempotent); an overwritten tag is put back.  A joined writer only stops: the
        folder belongs to the coordinator, which removes it once every writer is done."""
        if self._open:
            self._open = False
            if self._txn is not None:
                self._txn.abort()
                self._restore_aside()


def _state_bytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj`` (dicts, lists, tuples)."""
    seen: dict[int, int] = {}

    def visit(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            s = v.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        elif isinstance(v, Mapping):
            for x in v.values():
                visit(x)
        elif isinstance(v, list | tuple):
            for x in v:
                visit(x)

    visit(obj)
    return sum(seen.values())


def write_tag(
    tag: NxdTag,
    root: str | Path,
    name: str,
    *,
    xser: bool = False,
    dp_size: int | None = None,
    zero1: bool | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``tag`` as ``<root>/<name>`` in NxD's native layout and return that path.

    A loop over :class:`TagWriter` (one code path for in-memory and streaming writers); ranks go in sorted order.

    Args:
        tag: the in-memory tag (model shards per (tp, pp, ep), optimizers merged over DP and keyed by name).
        root: the NxD checkpoint directory (created if needed).
        name: the tag name, e.g. ``step_1000``.
        xser: write the xser form (``use_xser=True``) instead of plain ``torch.save`` files.
        dp_size: the DP size to re-shard ZeRO-1 optimizers for (default: ``tag.meta.dp_size``).
        zero1: write ZeRO-1 optimizer dicts (default: ``tag.meta.zero1``); otherwise plain torch.optim dicts.
        overwrite: replace an existing ``<root>/<name>``.
    """
    dp = dp_size if dp_size is not None else tag.meta.dp_size
    zero = tag.meta.zero1 if zero1 is None else zero1
    if dp < 1:
        raise CkptError(f"dp_size must be >= 1, got {dp}")
    ep_size = 1 + max((r[2] for r in tag.per_rank_model), default=0)
    experts = {n for sd in tag.per_rank_model.values() for n in sd if EXPERT_STACKED.match(n)}
    with TagWriter(
        Path(root) / name, xser=xser, dp_size=dp, zero1=zero, ep_size=ep_size, overwrite=overwrite,
        expert_tensors=experts,
    ) as w:  # fmt: skip
        for rank in sorted(set(tag.per_rank_model) | set(tag.per_rank_optimizer)):
            w.write_rank(rank, tag.per_rank_model.get(rank), tag.per_rank_optimizer.get(rank))
        return w.finish(tag.scheduler, tag.user_content)
