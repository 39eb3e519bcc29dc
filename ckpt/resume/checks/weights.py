"""Checkpoint facts about the weights themselves: was the model restored, and does each checkpoint hold its step's.

Two defects no loss curve proves (a model back at an earlier state can train on as smoothly as the right one):

* the model after a restore is not the checkpoint's: the restore event carries the model's digest right after
  loading (``CheckpointManager`` and ``CkptCallback`` log it), compared with the restored checkpoint's digest; a
  load that matched no key, or a model re-initialised after the load, is named with how many tensors differ;
* a checkpoint holds the same weights as an earlier one although steps were trained in between (a save made while
  other weights were swapped in, a stale reference saved): the restored checkpoint's digest is compared with the
  run's earlier checkpoints' (unless every logged LR between them is 0, when identical weights are expected).

Digests come from :mod:`ckpt.converters.digest` (our format: the manifest's chunk checksums, no data read; a Trainer
``checkpoint-N``: hashed through the conversion engine) and are compared by :func:`ckpt.converters.diff.compare_digests`.
"""

from __future__ import annotations

import os
from typing import Any

from ckpt.resume.checks.base import Basis, Cause, CheckResult, Confidence, Status
from ckpt.resume.checks.context import CheckContext

NAME = "weights"
#: tensor names quoted in a verdict
QUOTED = 3


def digests_of(facts: Any) -> Any:
    """The facts provider as the weights check's digest source when it gives digests (``digest``/``checkpoints``:
    the manifest, Trainer and NxD tag providers), else None."""
    return facts if callable(getattr(facts, "digest", None)) else None


def _label(path: str | None, step: int) -> str:
    return os.path.basename(str(path).rstrip("/")) if path else f"the checkpoint of step {step}"


def _names(names: tuple[str, ...]) -> str:
    more = f", +{len(names) - QUOTED} more" if len(names) > QUOTED else ""
    return ", ".join(names[:QUOTED]) + more


def _trained_between(ctx: CheckContext, lo: int, hi: int) -> bool:
    """False only when every step logged in (lo, hi] used LR 0 (identical weights are then expected)."""
    lrs = [r.lr for s, r in ctx.boundary.pre.items() if lo < s <= hi and r.lr is not None]
    return not lrs or any(lr != 0 for lr in lrs)


def check_weights(ctx: CheckContext) -> CheckResult:
    from ckpt.converters.diff import compare_digests

    b = ctx.boundary
    n = b.restored_step
    w = ctx.weights
    if w is None:
        return CheckResult(NAME, Status.SKIP, "no readable checkpoints: model digests not compared")
    path = b.restore.path if b.restore is not None else None
    cur = w.digest(n, path)
    if cur is None:
        return CheckResult(
            NAME, Status.SKIP, f"checkpoint of step {n} unreadable: model digests not compared"
        )
    label = _label(path, n)
    nums: dict[str, Any] = {"checkpoint": label, "tensors": len(cur.tensors)}
    live = b.restore.model_digest if b.restore is not None else None
    done = []
    if live:
        cmp = compare_digests(cur.tensors, live)
        nums.update(compared=cmp.total, not_restored=cmp.not_matching)
        if cmp.not_matching:
            which = cmp.differ + cmp.only_a
            absent = f"; {len(cmp.only_a)} not in the model at all" if cmp.only_a else ""
            return CheckResult(
                NAME,
                Status.FAIL,
                f"weights after restore differ from {label}'s: not restored ({cmp.not_matching} of {cmp.total} "
                f"tensors differ: {_names(which)}{absent})",
                Cause.WEIGHTS_NOT_RESTORED,
                nums,
            ).judged(Basis.CHECKPOINT, Confidence.EXACT)
        done.append(f"weights after restore equal {label}'s ({cmp.total} tensors)")
    earlier = sorted(((s, p) for s, p in w.checkpoints() if s < n), reverse=True)
    compared = 0
    for s, p in earlier:
        old = w.digest(s, p)
        if old is None or old.layout != cur.layout:
            continue
        compared += 1
        if compare_digests(old.tensors, cur.tensors).same and _trained_between(ctx, s, n):
            nums.update(same_as_step=s, same_as=_label(p, s))
            return CheckResult(
                NAME,
                Status.FAIL,
                f"{label} holds the same model as {_label(p, s)} (steps {s + 1}..{n} were trained in between: "
                f"the checkpoint of step {n} saved stale weights)",
                Cause.STALE_CHECKPOINT,
                nums,
            ).judged(Basis.CHECKPOINT, Confidence.EXACT)
    nums["earlier_compared"] = compared
    if compared:
        done.append(f"{label} differs from the {compared} earlier checkpoint{'s' if compared != 1 else ''}")
    if not done:
        return CheckResult(
            NAME,
            Status.SKIP,
            f"no restore digest logged and no earlier checkpoint to compare {label} with",
            None,
            nums,
        )
    return CheckResult(NAME, Status.PASS, "; ".join(done), None, nums).judged(
        Basis.CHECKPOINT, Confidence.EXACT
    )
