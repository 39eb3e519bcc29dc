"""Data and RNG continuity from per-step digests: exact even on nondeterministic hardware.

The training loop logs a hash of each batch's sample ids and of the RNG state (``digest_ids`` /
``digest_rng``).  A resumed session must log the same digests as the pre-crash session at every step both
logged; a batch digest equal to an *earlier* step's means samples were repeated (the loader restarted).
"""

from __future__ import annotations

from ckpt.resume.checks.base import Basis, Cause, CheckResult, Confidence, Status
from ckpt.resume.checks.context import CheckContext


def _earlier(ctx: CheckContext, attr: str, digest: str, before: int) -> int | None:
    """The earliest pre step (< ``before``) that logged ``digest``, if the pre log never repeats itself."""
    pre = ctx.boundary.pre
    seen: dict[str, int] = {}
    for s in sorted(pre):
        d = getattr(pre[s], attr)
        if d is None:
            continue
        if d in seen:
            return None  # digests repeat in normal training (no reshuffle): a repeat proves nothing
        seen[d] = s
    hit = seen.get(digest)
    return hit if hit is not None and hit < before else None


def check_data(ctx: CheckContext) -> CheckResult:
    b = ctx.boundary
    pre = b.pre
    nums: dict[str, int | str | None] = {}
    pairs = [(r, pre[r.step]) for r in b.post.steps if r.step in pre]
    dd = [(r.step, p.data_digest, r.data_digest) for r, p in pairs if r.data_digest and p.data_digest]
    sm = [(r.step, p.samples, r.samples) for r, p in pairs if r.samples is not None and p.samples is not None]
    checked = []
    if dd:
        nums["digests_compared"] = len(dd)
        checked.append(f"{len(dd)} batch digests")
        bad = [(s, a, c) for s, a, c in dd if a != c]
        if bad:
            s, a, c = bad[0]
            nums.update(first_mismatch=s, mismatched=len(bad))
            j = _earlier(ctx, "data_digest", c, s)
            extra = f"; its batch equals step {j}'s (samples repeated)" if j is not None else ""
            if j is not None:
                nums["repeats_step"] = j
            return CheckResult(
                "data",
                Status.FAIL,
                f"step {s}: batch digest {c} differs from the pre-crash {a} "
                f"({len(bad)}/{len(dd)} steps){extra}",
                Cause.DATA_POSITION_LOST,
                nums,
            )
    if sm:
        nums["samples_compared"] = len(sm)
        checked.append(f"{len(sm)} sample counts")
        bad_s = [(s, a, c) for s, a, c in sm if a != c]
        if bad_s:
            s, a, c = bad_s[0]
            nums.update(first_mismatch=s, pre_samples=a, post_samples=c)
            return CheckResult(
                "data",
                Status.FAIL,
                f"step {s}: {c} samples consumed, {a} before the crash",
                Cause.DATA_POSITION_LOST,
                nums,
            )
    if not checked:
        # No overlap: the post batches must at least not repeat earlier ones, and the sample count must
        # continue from N by the usual per-step increment.
        first = b.post.steps[0]
        n = b.restored_step
        if first.data_digest:
            j = _earlier(ctx, "data_digest", first.data_digest, first.step)
            if j is not None:
                nums["repeats_step"] = j
                return CheckResult(
                    "data",
                    Status.FAIL,
                    f"step {first.step} consumed the batch of step {j} (samples repeated)",
                    Cause.DATA_POSITION_LOST,
                    nums,
                )
        at_n, before_n = pre.get(n), pre.get(n - 1)
        if (
            first.samples is not None
            and at_n
            and before_n
            and at_n.samples is not None
            and before_n.samples is not None
        ):
            expected = at_n.samples + (at_n.samples - before_n.samples)
            nums.update(expected_samples=expected, post_samples=first.samples)
            if first.samples != expected:
                return CheckResult(
                    "data",
                    Status.FAIL,
                    f"step {first.step}: {first.samples} samples consumed, expected {expected}",
                    Cause.DATA_POSITION_LOST,
                    nums,
                )
            return CheckResult(
                "data", Status.PASS, "sample count continues from the restored step", None, nums
            )
        return CheckResult("data", Status.SKIP, "no overlapping data digests or sample counts", None, nums)
    return CheckResult("data", Status.PASS, " and ".join(checked) + " equal to the pre-crash run", None, nums)


def check_rng(ctx: CheckContext) -> CheckResult:
    b = ctx.boundary
    pre = b.pre
    pairs = [(r.step, pre[r.step].rng_digest, r.rng_digest) for r in b.post.steps if r.step in pre]
    pairs = [(s, a, c) for s, a, c in pairs if a and c]
    if not pairs:
        return _rng_without_overlap(ctx)
    nums: dict[str, int | str | None] = {"compared": len(pairs)}
    bad = [(s, a, c) for s, a, c in pairs if a != c]
    if not bad:
        return CheckResult(
            "rng", Status.PASS, f"{len(pairs)} RNG digests equal to the pre-crash run", None, nums
        )
    s, a, c = bad[0]
    nums.update(first_mismatch=s, mismatched=len(bad))
    j = _earlier(ctx, "rng_digest", c, s)
    extra = f"; it equals step {j}'s state (re-seeded)" if j is not None else ""
    return CheckResult(
        "rng",
        Status.FAIL,
        f"step {s}: RNG digest {c} differs from the pre-crash {a} ({len(bad)}/{len(pairs)} steps){extra}",
        Cause.RNG_NOT_RESTORED,
        nums,
    )


def _rng_without_overlap(ctx: CheckContext) -> CheckResult:
    """No overlap: the first resumed step's RNG state must not be one the run already had (a process that
    re-seeds and does not restore the RNG starts from the state of its first step again)."""
    b = ctx.boundary
    first = b.post.steps[0]
    if not first.rng_digest:
        return CheckResult("rng", Status.SKIP, "no overlapping RNG digests")
    j = _earlier(ctx, "rng_digest", first.rng_digest, first.step)
    if j is None:
        return CheckResult(
            "rng", Status.PASS, f"step {first.step}'s RNG state is new to the run (no overlap to compare)"
        ).judged(Basis.TRAJECTORY, Confidence.LOW)
    return CheckResult(
        "rng",
        Status.FAIL,
        f"step {first.step} starts from the RNG state of step {j} (re-seeded, not restored)",
        Cause.RNG_NOT_RESTORED,
        {"repeats_step": j},
    ).judged(Basis.TRAJECTORY, Confidence.HIGH)
