"""Write an :class:`~converters.nxd.reader.NxdTag` as an NxD-native tag that NxD's ``load_checkpoint`` loads.

Same names and structure as ``neuronx_distributed.trainer.save_checkpoint`` (verified byte-for-byte on the pickled
structure of the fixtures): ``checkpoint`` marker, ``model/dp_rank_00[_ep_rank_EE]_tp_rank_TT_pp_rank_PP.pt``,
``optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt`` (ZeRO-1 re-sharded for the requested DP size, padding and master
weights included), ``scheduler.pt``, ``user_content.pt``, and ``done`` last.  xser writes ``X.pt`` (refs),
``X.pt.tensors/tensor_<tid>.pt`` and ``X.pt.info.pt``.

Streaming: :class:`TagWriter` takes the tag one (tp, pp, ep) rank at a time (model shard + optimizer), so a
producer that builds ranks one by one (``export_tag``, ``ckpt convert --format nxd``) holds one rank's state, never
the whole tag; :func:`write_tag` is a loop over it for a tag already in memory.

Atomicity: the tag is built in a hidden temporary folder next to the target (same filesystem) and renamed into
place; ``done`` is written after the rename and fsynced, so a crash leaves either nothing, a hidden temp folder, or
an ``unmarked`` tag whose files are all there, never a ``done`` over partial files.
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

from .naming import RankKey, rank_file_name
from .reader import NxdTag
from .xser import save_nxd_file
from .zero1 import shard_zero1_optimizer, unshard_plain_optimizer


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class TagWriter:
    """Write an NxD-native tag one (tp, pp, ep) rank at a time, so memory holds one rank's state, not the tag.

    NxD stores one ``torch.save`` file per rank (and, with ZeRO-1, one optimizer file per DP rank of it), so a rank's
    model shard plus its optimizer is the smallest unit that can be written; the caller builds each rank, hands it to
    :meth:`write_rank` and drops it.  The folder protocol is :func:`write_tag`'s (which is a loop over this class):
    ``checkpoint`` first in a hidden ``.<name>.tmp-XXXX`` next to the target, rank files as they come,
    ``scheduler.pt`` / ``user_content.pt`` and the rename in :meth:`finish`, ``done`` last.  Any exception inside
    ``with TagWriter(...)`` (or :meth:`abort`) removes the temp folder: nothing partial is ever at ``<root>/<name>``.

    Args:
        root: the NxD checkpoint directory (created if needed).
        name: the tag name, e.g. ``step_1000``.
        xser: write the xser form (``use_xser=True``) instead of plain ``torch.save`` files.
        dp_size: the DP size ZeRO-1 optimizers are sharded for.
        zero1: write ZeRO-1 optimizer dicts; otherwise plain torch.optim dicts.
        ep_size: expert-parallel size (file names carry an ep field iff it is > 1); must be known before the first
            file is named.
        overwrite: replace an existing ``<root>/<name>`` (at :meth:`finish`).
        join: the temp folder (:attr:`tmp`) of another ``TagWriter`` for the same tag, made by a coordinator: this
            writer only adds rank files to it (parallel writers, one process or torchrun rank each, writing
            disjoint ranks).  It never creates, renames or removes the folder: :meth:`finish` is refused and
            :meth:`abort` only stops it; the coordinator's writer publishes or removes the folder.
    """

    def __init__(
        self,
        root: str | Path,
        name: str,
        *,
        xser: bool = False,
        dp_size: int = 1,
        zero1: bool = True,
        ep_size: int = 1,
        overwrite: bool = False,
        join: str | Path | None = None,
    ) -> None:
        if dp_size < 1:
            raise CkptError(f"dp_size must be >= 1, got {dp_size}")
        self.root = Path(root)
        self.name = name
        self.final = self.root / name
        self.xser = xser
        self.dp_size = dp_size
        self.zero1 = zero1
        self.ep_size = ep_size
        self.overwrite = overwrite
        #: largest number of tensor bytes (distinct storages) one :meth:`write_rank` call was handed: the state a
        #: streaming producer holds at once, reported so callers and tests can check the bound
        self.max_rank_bytes = 0
        self._written: set[RankKey] = set()
        self.owner = join is None
        if join is not None:
            self.tmp = Path(join)
            if not (self.tmp / "checkpoint").is_file() or not (self.tmp / "model").is_dir():
                raise CkptError(f"{self.tmp}: not the temp folder of a tag being written")
            return
        if self.final.exists() and not overwrite:
            raise CheckpointExistsError(f"{self.final}: already exists (pass overwrite=True to replace it)")
        self.root.mkdir(parents=True, exist_ok=True)
        self.tmp: Path | None = self.root / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        try:
            _write_text(self.tmp / "checkpoint", "1")
            (self.tmp / "model").mkdir()
        except BaseException:
            self.abort()
            raise

    def __enter__(self) -> TagWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None:
            self.abort()

    def _dir(self) -> Path:
        if self.tmp is None:
            raise CkptError(f"{self.final}: tag writer already finished or aborted")
        return self.tmp

    def write_rank(
        self,
        rank: RankKey,
        model: Mapping[str, torch.Tensor] | None,
        optimizer: Mapping[str, Any] | None = None,
    ) -> None:
        """Write rank ``(tp, pp, ep)``: its model file and, when given, its optimizer file(s).

        ``model`` is the rank's TP-local state dict in NxD order; ``optimizer`` is the named form of
        :class:`NxdTag` (``state``/``param_groups``/``master_weights``/``extra``), re-sharded here for ZeRO-1 with
        shapes from ``model``.  Once this returns the caller may drop both: nothing is kept.
        """
        tmp = self._dir()
        if rank in self._written:
            raise CkptError(f"{self.final}: rank {rank} written twice")
        tp, pp, ep = rank
        self.max_rank_bytes = max(self.max_rank_bytes, _state_bytes((model, optimizer)))
        try:
            if model is not None:
                fname = rank_file_name(0, tp, pp, ep if self.ep_size > 1 else None)
                save_nxd_file(dict(model), tmp / "model" / fname, self.xser)
            if optimizer is not None:
                (tmp / "optim").mkdir(exist_ok=True)
                if self.zero1:
                    if self.ep_size > 1:
                        raise CkptError(
                            f"{self.final}: writing ZeRO-1 optimizers with expert parallelism is not supported"
                        )
                    where = f"{self.final}/optim tp {tp} pp {pp} ep {ep}"
                    shapes = {k: tuple(v.shape) for k, v in (model or {}).items()}
                    for r, d in enumerate(
                        shard_zero1_optimizer(optimizer, shapes, self.dp_size, where=where)
                    ):
                        save_nxd_file(d, tmp / "optim" / rank_file_name(r, tp, pp), self.xser)
                else:
                    fname = rank_file_name(0, tp, pp, ep if self.ep_size > 1 else None)
                    save_nxd_file(unshard_plain_optimizer(optimizer), tmp / "optim" / fname, self.xser)
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
        """Write ``scheduler.pt`` / ``user_content.pt`` (when not None), rename into place, write ``done``."""
        tmp = self._dir()
        if not self.owner:
            raise CkptError(f"{self.final}: a joined tag writer cannot finish; the coordinator's writer does")
        try:
            if scheduler is not None:
                save_nxd_file(scheduler, tmp / "scheduler.pt", False)
            if user_content is not None:
                save_nxd_file(user_content, tmp / "user_content.pt", False)
            _fsync_dir(tmp)
            if self.final.exists():
                if not self.overwrite:  # appeared while we were writing
                    raise CheckpointExistsError(
                        f"{self.final}: already exists (pass overwrite=True to replace it)"
                    )
                shutil.rmtree(self.final)
            os.replace(tmp, self.final)
        except BaseException:
            self.abort()
            raise
        self.tmp = None
        _fsync_dir(self.root)
        _write_text(self.final / "done", "1")
        _fsync_dir(self.final)
        return self.final

    def abort(self) -> None:
        """Remove the temp folder (idempotent); the target is untouched.  A joined writer only stops: the folder
        belongs to the coordinator, which removes it once every writer is done (removing it under the other
        writers would turn one failure into confusing errors everywhere)."""
        if self.tmp is not None:
            if self.owner:
                shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


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
    if zero and ep_size > 1 and tag.per_rank_optimizer:
        raise CkptError(
            f"{Path(root) / name}: writing ZeRO-1 optimizers with expert parallelism is not supported"
        )
    with TagWriter(root, name, xser=xser, dp_size=dp, zero1=zero, ep_size=ep_size, overwrite=overwrite) as w:
        for rank in sorted(set(tag.per_rank_model) | set(tag.per_rank_optimizer)):
            w.write_rank(rank, tag.per_rank_model.get(rank), tag.per_rank_optimizer.get(rank))
        return w.finish(tag.scheduler, tag.user_content)
