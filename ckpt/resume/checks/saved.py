"""Save-time facts against the restore: was the saved RNG state put back, does checkpoint N hold step N's weights.

Why: with no step logged both before the crash and after the resume, a restore that skipped the RNG or a checkpoint
written from other weights than step N's (an async save that copied too early) move nothing the logs show.  The
save event of the restored step carries what the run had when it saved (:mod:`ckpt.state.save_facts`): the
digests of the RNG streams the checkpoint captured and a sampled fingerprint of the live weights.  The restore
event carries the RNG digests right after the restore; the checkpoint itself is read for the same weight sample.
Each comparison is exact; where a fact is missing (an older ledger, an unreadable checkpoint, another layout) it is
silent and the other checks decide as before.  Called by :func:`ckpt.resume.checks.digests.check_rng` and
:func:`ckpt.resume.checks.weights.check_weights`.
"""

from __future__ import annotations

import os

from ckpt.resume.checks.base import Basis, Cause, CheckResult, Confidence, Status
from ckpt.resume.checks.context import CheckContext
from ckpt.words import count

QUOTED = 3


def _names(names: list[str]) -> str:
    more = f", +{len(names) - QUOTED} more" if len(names) > QUOTED else ""
    return ", ".join(names[:QUOTED]) + more


def saved_rng(ctx: CheckContext) -> CheckResult | None:
    """The RNG right after the restore against the state saved with the restored checkpoint: FAIL naming the
    streams that differ, PASS when all common streams are equal; None when either side was not logged."""
    b = ctx.boundary
    r = b.restore
    if r is None or r.inferred or not r.rng_digests:
        return None
    save = b.save_of(b.restored_step)
    if save is None or not save.rng_digests:
        return None
    common = [k for k in save.rng_digests if k in r.rng_digests]
    if not common:
        return None
    differ = [k for k in common if save.rng_digests[k] != r.rng_digests[k]]
    n = b.restored_step
    nums: dict[str, int | str | None] = {"streams": len(common), "streams_differ": len(differ)}
    if differ:
        return CheckResult(
            "rng",
            Status.FAIL,
            f"RNG state not restored: after the restore {count(len(differ), 'stream')} of {len(common)} "
            f"({', '.join(differ)}) {'differs' if len(differ) == 1 else 'differ'} from the state saved with "
            f"checkpoint {n}",
            Cause.RNG_NOT_RESTORED,
            nums,
        ).judged(Basis.CHECKPOINT, Confidence.EXACT)
    return CheckResult(
        "rng",
        Status.PASS,
        f"the RNG after the restore equals the state saved with checkpoint {n} ({count(len(common), 'stream')})",
        None,
        nums,
    ).judged(Basis.CHECKPOINT, Confidence.EXACT)


def saved_weights(ctx: CheckContext) -> CheckResult | None:
    """The restored checkpoint's weights, sampled, against the fingerprint the run took of its live weights when it
    saved that step: FAIL naming the tensors that differ, PASS when every common tensor is equal; None when the
    fingerprint was not logged, the checkpoint cannot be read, or no tensor compares (another layout)."""
    from ckpt.state.save_facts import compare_samples

    b = ctx.boundary
    n = b.restored_step
    save = b.save_of(n)
    read = getattr(ctx.weights, "sample", None)
    if save is None or not save.weights_sample or not callable(read):
        return None
    path = b.restore.path if b.restore is not None and b.restore.path else save.path
    stored = read(n, path)
    if not stored:
        return None
    compared, differ = compare_samples(save.weights_sample, stored)
    if not compared:
        return None
    label = os.path.basename(str(path).rstrip("/")) if path else f"the checkpoint of step {n}"
    nums: dict[str, int | str | None] = {"sampled_tensors": compared, "sample_differs": len(differ)}
    if differ:
        return CheckResult(
            "weights",
            Status.FAIL,
            f"{label} does not hold step {n}'s weights (saved from another step: an early copy): "
            f"{len(differ)} of {compared} sampled tensors differ from the weights the run had when it saved "
            f"step {n}: {_names(differ)}",
            Cause.STALE_CHECKPOINT,
            nums,
        ).judged(Basis.CHECKPOINT, Confidence.EXACT)
    return CheckResult(
        "weights",
        Status.PASS,
        f"{label} holds the weights the run had when it saved step {n} "
        f"({count(compared, 'sampled tensor')} equal)",
        None,
        nums,
    ).judged(Basis.CHECKPOINT, Confidence.EXACT)


def unchecked_without_overlap(checks: list[CheckResult], step: int) -> list[str]:
    """What a boundary with no overlapping step cannot check, from its check results: an LR scaled inside the
    optimizer step while the logged LR is not (only the losses of steps logged twice show it) always; whether the
    RNG was restored and whether checkpoint ``step`` holds step ``step``'s weights where no save-time fact
    decided it (a ledger without them, an unreadable checkpoint)."""
    by = {c.name: c for c in checks}
    out = ["an LR changed inside optimizer.step while the logged LR is not (lr_scaled_silently)"]
    rng = by.get("rng")
    if rng is not None and rng.status is not Status.FAIL and "streams" not in rng.numbers:
        out.append("whether the RNG state was restored (no RNG digests in the save and restore events)")
    w = by.get("weights")
    if w is not None and w.status is not Status.FAIL and "sampled_tensors" not in w.numbers:
        out.append(
            f"whether checkpoint {step} holds step {step}'s weights rather than an early copy "
            "(no weight fingerprint in its save event, or the checkpoint unreadable)"
        )
    return out
