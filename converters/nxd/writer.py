"""Write an :class:`~converters.nxd.reader.NxdTag` as an NxD-native tag that NxD's ``load_checkpoint`` loads.

Same names and structure as ``neuronx_distributed.trainer.save_checkpoint`` (verified byte-for-byte on the pickled
structure of the fixtures): ``checkpoint`` marker, ``model/dp_rank_00[_ep_rank_EE]_tp_rank_TT_pp_rank_PP.pt``,
``optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt`` (ZeRO-1 re-sharded for the requested DP size, padding and master
weights included), ``scheduler.pt``, ``user_content.pt``, and ``done`` last.  xser writes ``X.pt`` (refs),
``X.pt.tensors/tensor_<tid>.pt`` and ``X.pt.info.pt``.

Atomicity: the tag is built in a hidden temporary folder next to the target (same filesystem) and renamed into
place; ``done`` is written after the rename and fsynced, so a crash leaves either nothing, a hidden temp folder, or
an ``unmarked`` tag whose files are all there, never a ``done`` over partial files.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from ckpt.errors import CheckpointExistsError, CkptError

from .naming import rank_file_name
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

    Args:
        tag: the in-memory tag (model shards per (tp, pp, ep), optimizers merged over DP and keyed by name).
        root: the NxD checkpoint directory (created if needed).
        name: the tag name, e.g. ``step_1000``.
        xser: write the xser form (``use_xser=True``) instead of plain ``torch.save`` files.
        dp_size: the DP size to re-shard ZeRO-1 optimizers for (default: ``tag.meta.dp_size``).
        zero1: write ZeRO-1 optimizer dicts (default: ``tag.meta.zero1``); otherwise plain torch.optim dicts.
        overwrite: replace an existing ``<root>/<name>``.
    """
    root = Path(root)
    dp = dp_size if dp_size is not None else tag.meta.dp_size
    zero = tag.meta.zero1 if zero1 is None else zero1
    if dp < 1:
        raise CkptError(f"dp_size must be >= 1, got {dp}")
    ep_size = 1 + max((r[2] for r in tag.per_rank_model), default=0)
    if zero and ep_size > 1 and tag.per_rank_optimizer:
        raise CkptError(f"{root / name}: writing ZeRO-1 optimizers with expert parallelism is not supported")
    final = root / name
    if final.exists() and not overwrite:
        raise CheckpointExistsError(f"{final}: already exists (pass overwrite=True to replace it)")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_text(tmp / "checkpoint", "1")
        (tmp / "model").mkdir()
        for (tp, pp, ep), sd in sorted(tag.per_rank_model.items()):
            fname = rank_file_name(0, tp, pp, ep if ep_size > 1 else None)
            save_nxd_file(dict(sd), tmp / "model" / fname, xser)
        if tag.per_rank_optimizer:
            (tmp / "optim").mkdir()
        for (tp, pp, ep), opt in sorted(tag.per_rank_optimizer.items()):
            where = f"{final}/optim tp {tp} pp {pp} ep {ep}"
            if zero:
                shapes = {k: tuple(v.shape) for k, v in tag.per_rank_model.get((tp, pp, ep), {}).items()}
                for r, d in enumerate(shard_zero1_optimizer(opt, shapes, dp, where=where)):
                    save_nxd_file(d, tmp / "optim" / rank_file_name(r, tp, pp), xser)
            else:
                fname = rank_file_name(0, tp, pp, ep if ep_size > 1 else None)
                save_nxd_file(unshard_plain_optimizer(opt), tmp / "optim" / fname, xser)
        if tag.scheduler is not None:
            save_nxd_file(tag.scheduler, tmp / "scheduler.pt", False)
        if tag.user_content is not None:
            save_nxd_file(tag.user_content, tmp / "user_content.pt", False)
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    _write_text(final / "done", "1")
    _fsync_dir(final)
    return final
