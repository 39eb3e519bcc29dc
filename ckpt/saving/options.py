"""What a save records besides the training objects, and how it runs: :class:`SaveOptions`.

:meth:`ckpt.Checkpointer.save` takes the training objects as keywords (``model=``, ``optimizer=``, ...) and
everything else as one ``options=SaveOptions(...)``.  The user-facing calls (``CheckpointManager.save(step, ...)``,
``ckpt.save(path, step=..., ...)``) keep accepting the options as plain keywords; :func:`split_keywords` is the one
place that translates them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..format.manifest import Layout
    from .commit import SaveResult

#: The training objects a save captures, passed to :meth:`ckpt.Checkpointer.save` as keywords of these names.
STATE_KEYWORDS = ("model", "optimizer", "scheduler", "scaler", "dataloader", "tokenizer")


@dataclass(frozen=True)
class SaveOptions:
    """Everything about one save except the training objects (all optional).

    What else is recorded:
        rng: capture every rank's RNG streams (Python, NumPy, torch, CUDA/XLA).
        rng_seed: the base seed from which a restore on another DP size re-derives per-rank RNG streams
            (default: derived from rank 0's RNG state).
        progress: counters recorded next to ``step`` in the manifest's ``progress`` (JSON).
        metadata: the caller's own tree, recorded as the manifest's ``user`` (treecodec-encodable).
        layout: the parallel layout recorded in the manifest (default: data-parallel over all ranks, or the
            DTensor mesh).
        extra: the manifest's ``extra`` (JSON; backend/converter facts such as ``extra.nxd``).
        adapter_only: save the trainable parameters only, with their optimizer state, and record the frozen base
            by identity in ``manifest.adapter`` (a fine-tune of a frozen base: PEFT, NxD ``LoraModel``).
        base_source: where that base was loaded from (default: its config's ``_name_or_path``).

    How it runs:
        overwrite: replace a committed checkpoint at the same path (else :class:`ckpt.CheckpointExistsError`).
        on_commit: called on rank 0 with the :class:`SaveResult` once the manifest is written (its errors only
            warn: the checkpoint is committed).
        verify_replicas: compare replicated copies across ranks in this save (default: on the checkpointer's
            first save, or always when it was made with ``verify_replicas=True``).
        lazy: async saves copy the optimizer's tensors in the background (default: the checkpointer's ``lazy``).
    """

    rng: bool = True
    rng_seed: int | None = None
    progress: dict[str, Any] | None = None
    metadata: Any = None
    layout: Layout | None = None
    extra: dict[str, Any] | None = None
    adapter_only: bool = False
    base_source: str | None = None
    overwrite: bool = False
    on_commit: Callable[[SaveResult], None] | None = None
    verify_replicas: bool | None = None
    lazy: bool | None = None


OPTION_KEYWORDS = tuple(f.name for f in dataclasses.fields(SaveOptions))


def split_keywords(keywords: Mapping[str, Any], caller: str = "save") -> tuple[dict[str, Any], SaveOptions]:
    """The training objects and the :class:`SaveOptions` of a user-facing ``save(**keywords)`` call.

    ``options=SaveOptions(...)`` is accepted too, but not together with option keywords (two sources of one
    setting).  An unknown keyword is a ``TypeError`` naming it, as Python's own for a misspelled argument.
    """
    state: dict[str, Any] = {}
    chosen: dict[str, Any] = {}
    given: SaveOptions | None = None
    for name, value in keywords.items():
        if name in STATE_KEYWORDS:
            state[name] = value
        elif name in OPTION_KEYWORDS:
            chosen[name] = value
        elif name == "options":
            if not isinstance(value, SaveOptions):
                raise TypeError(f"{caller}() options={value!r}: expected a ckpt.SaveOptions")
            given = value
        else:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    if given is not None and chosen:
        raise TypeError(
            f"{caller}() got options= and {', '.join(sorted(chosen))}=: pass the options one way, not both"
        )
    return state, given if given is not None else SaveOptions(**chosen)


__all__ = ["OPTION_KEYWORDS", "STATE_KEYWORDS", "SaveOptions", "split_keywords"]
