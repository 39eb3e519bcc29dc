"""Checkpoint facts about the weights themselves: was the model restored, and does each checkpoint hold its step's.

Two defects no loss curve proves (a model back at an earlier state can train on as smoothly as the right one):

* the model after a restore is not the checkpoint's: the restore event carries the model's digest right after
  loading (``CheckpointManager`` and ``CkptCallback`` log it, with the view each tensor was hashed in), compared
  with the restored checkpoint's digest where both are in one view (:func:`ckpt.converters.digest.common_view`):
  first the checkpoint's stored layout (our format: the chunk checksums, no data read), then, for what that leaves,
  the conversion engine's full HF-named view (one read of the checkpoint: a Neuron layout, other chunks).  Only
  tensors held in the same view whose bytes differ, or tensors the restore itself says it did not load
  (``strict=False``), are evidence of a failed restore; names that do not map, dtypes or shapes that differ, a
  sharded model or a layout the engine cannot present leave the comparison skipped, with the reason;
* a checkpoint holds the same weights as an earlier one although steps were trained in between (a save made while
  other weights were swapped in, a stale reference saved): the restored checkpoint's digest is compared with the
  run's earlier checkpoints' (unless every logged LR between them is 0, when identical weights are expected).
* a checkpoint N holds the weights of another step than N (an async save that copied too early): the save event's
  fingerprint of the live weights at step N against the same sample read from the checkpoint
  (:func:`ckpt.resume.checks.saved.saved_weights`).

Digests come from :mod:`ckpt.converters.digest` and are compared by :func:`ckpt.converters.digest.compare_digests`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt.resume.checks.base import Basis, Cause, CheckResult, Confidence, Status
from ckpt.resume.checks.context import CheckContext
from ckpt.resume.checks.saved import saved_weights

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


@dataclass(frozen=True)
class _Restored:
    """The restore digest against the checkpoint: names compared equal / differing, whether the engine's HF view
    was used, and the live names left uncompared with why."""

    compared: int
    differ: tuple[str, ...]
    hf_view: bool
    left: tuple[str, ...]
    why: str


def _why(live_views: Mapping[str, str], left: list[str], ref: Any, ref_label: str) -> str:
    """Why ``left`` could not be compared, with an example: no tensor of that name in the checkpoint's view, or
    one in another dtype, shape or layout."""
    absent = [n for n in left if n not in ref.tensors]
    other = [n for n in left if n in ref.tensors]
    parts = []
    if absent:
        ours = sorted(ref.tensors)
        have = f" (it holds {_names(tuple(ours))})" if ours else ""
        parts.append(
            f"{len(absent)} with no tensor of their name in {ref_label}{have}: {_names(tuple(absent))}"
        )
    if other:
        n = other[0]
        parts.append(
            f"{len(other)} in another dtype, shape or layout ({n}: the model's {live_views.get(n)}, "
            f"the checkpoint's {ref.views.get(n)})"
        )
    return "; ".join(parts)


def _compare_restore(ctx: CheckContext, cur: Any, path: str | None, label: str) -> _Restored | str:
    """The restore digest compared with the checkpoint's in a common view, or why it cannot be (a string)."""
    from ckpt.converters.digest import UNKNOWN, common_view, compare_digests, whole

    r = ctx.boundary.restore
    assert r is not None and r.model_digest
    live, views = r.model_digest, r.model_views
    if views is None:
        return "the restore digest was logged without the view of each tensor (by an older ckpt)"
    if all(v == UNKNOWN for v in live.values()):
        return "rank 0 held none of the model's tensors whole (a sharded model: DTensor or TP parts)"
    ck, lv, left = common_view(live, views, cur, live)
    ref, ref_label, hf_view = cur, label, False
    if left and (not cur.hf or any(whole(cur.views.get(n, "")) == views.get(n) for n in left)):
        # the stored layout is not the model's (a Neuron layout, other chunks): the engine's full view.  An HF-view
        # checkpoint differs from that only in its boxes, so it is read only where whole tensors would compare.
        full = getattr(ctx.weights, "view_digest", None)
        got = full(ctx.boundary.restored_step, path) if callable(full) else None
        if got is None:
            if not ck:
                return f"{label} is stored in another layout than the model's and cannot be read in full as HF tensors"
        else:
            more_ck, more_lv, left = common_view(live, views, got, left)
            ck.update(more_ck)
            lv.update(more_lv)
            ref, ref_label, hf_view = got, f"{label}'s HF view", bool(more_ck)
    cmp = compare_digests(ck, lv)
    return _Restored(
        len(ck), cmp.differ, hf_view, tuple(left), _why(views, left, ref, ref_label) if left else ""
    )


def check_weights(ctx: CheckContext) -> CheckResult:
    from ckpt.converters.digest import compare_digests

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
    r = b.restore
    done = []
    skipped = None
    got = _compare_restore(ctx, cur, path, label) if r is not None and r.model_digest else None
    unloaded = r.unloaded if r is not None and r.unloaded and r.unfilled else ()
    if isinstance(got, str):
        skipped = f"weights after restore not compared with {label}'s: {got}"
    elif got is not None:
        nums.update(compared=got.compared, not_restored=len(got.differ), not_compared=len(got.left))
        nums["view"] = "hf" if got.hf_view else "stored"
    if unloaded or (isinstance(got, _Restored) and got.differ):
        differ = got.differ if isinstance(got, _Restored) else ()
        compared = got.compared if isinstance(got, _Restored) else 0
        extra = tuple(u for u in unloaded if u not in differ)
        bad = differ + extra
        nums.update(not_restored=len(bad))
        tail = (
            f"; {len(extra)} the restore did not load: no model tensor of that name, the model's own "
            f"{_names(r.unfilled)} left as they were"
            if extra and r is not None
            else ""
        )
        how = " (compared in its HF view)" if isinstance(got, _Restored) and got.hf_view else ""
        return CheckResult(
            NAME,
            Status.FAIL,
            f"weights after restore differ from {label}'s{how}: not restored ({len(bad)} of "
            f"{compared + len(extra)} tensors differ: {_names(bad)}{tail})",
            Cause.WEIGHTS_NOT_RESTORED,
            nums,
        ).judged(Basis.CHECKPOINT, Confidence.EXACT)
    sampled = saved_weights(ctx)
    if sampled is not None and sampled.status is Status.FAIL:
        sampled.numbers.update(nums)
        return sampled
    if sampled is not None:
        nums.update(sampled.numbers)
    if isinstance(got, _Restored):
        if got.compared:
            how = ", in its HF view" if got.hf_view else ""
            left = f"; {len(got.left)} not compared: {got.why}" if got.left else ""
            done.append(f"weights after restore equal {label}'s ({got.compared} tensors{how}){left}")
        else:
            skipped = f"weights after restore not compared with {label}'s: {got.why}"
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
    if sampled is not None:
        done.append(sampled.summary)
    if compared:
        done.append(f"{label} differs from the {compared} earlier checkpoint{'s' if compared != 1 else ''}")
    if skipped is not None or not done:
        # the restore could not be checked: a skip, whatever the earlier checkpoints showed
        first = skipped or f"no restore digest logged and no earlier checkpoint to compare {label} with"
        return CheckResult(NAME, Status.SKIP, "; ".join([first, *done]), None, nums)
    return CheckResult(NAME, Status.PASS, "; ".join(done), None, nums).judged(
        Basis.CHECKPOINT, Confidence.EXACT
    )
