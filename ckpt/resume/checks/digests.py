"""Data and RNG continuity from per-step digests: exact even on nondeterministic hardware.

The training loop logs a hash of each batch's sample ids and of the RNG state (``digest_ids`` /
``digest_rng``).  A resumed session must log the same digests as the pre-crash session at every step both
logged; a batch digest equal to an *earlier* step's means samples were repeated (the loader restarted).

Across a change of DP size (the crashed and the resumed session logged different world sizes) a rank's batch is
another part of the global batch, so only *global* digests compare: ``ckpt.data.global_digest`` (``ms:``, the
order-free sum over every rank's sample ids).  Sums add up, so when the global batch changed too, windows of
steps that consumed the same number of samples (from the logged ``samples`` counts) are compared.  The RNG check
reports which streams the restore carried and which it re-derived (ckpt's rule; facts from the checkpoint).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ckpt.data.digest import combine_digests, is_global
from ckpt.resume.checks.base import Basis, Cause, CheckResult, Confidence, Status
from ckpt.resume.checks.context import CheckContext
from ckpt.resume.checks.saved import saved_rng
from ckpt.resume.model import StepRecord
from ckpt.words import count


def dp_change(ctx: CheckContext) -> tuple[int, int] | None:
    """(saved, resumed) world sizes when the boundary changed the number of ranks, else None."""
    b = ctx.boundary
    after = b.post.env.get("world_size")
    before = b.dead.env.get("world_size") if b.dead is not None else None
    if before is None and ctx.facts is not None:
        before = ctx.facts.dp
    if isinstance(before, int) and isinstance(after, int) and before != after:
        return before, after
    return None


Nums = dict[str, int | str | None]
Check = Callable[[CheckContext], CheckResult]


def _unless_dp_changed(
    across: Callable[[CheckContext, tuple[int, int]], CheckResult],
) -> Callable[[Check], Check]:
    """The check, with ``across(ctx, (saved, resumed))`` in its place at a boundary that changed the number of
    ranks: a rank's digests are then of another part of the global batch and do not compare step by step."""

    def wrap(check: Check) -> Check:
        @functools.wraps(check)
        def run(ctx: CheckContext) -> CheckResult:
            change = dp_change(ctx)
            return check(ctx) if change is None else across(ctx, change)

        return run

    return wrap


def _lost(message: str, nums: Nums, basis: Basis | None = None) -> CheckResult:
    """A data FAIL: the resumed run does not stand where the crashed one stood in the data.  Judged exact on
    ``basis`` where the verdict compares the same samples before and after the crash."""
    result = CheckResult("data", Status.FAIL, message, Cause.DATA_POSITION_LOST, nums)
    return result if basis is None else result.judged(basis, Confidence.EXACT)


def _same(message: str, nums: Nums) -> CheckResult:
    """A data PASS from the same samples compared before and after the crash: exact."""
    return CheckResult("data", Status.PASS, message, None, nums).judged(Basis.OVERLAP, Confidence.EXACT)


def _windows(steps: list[StepRecord], start_samples: int | None) -> dict[int, str]:
    """Cumulative samples after each step -> digest of all samples since the restored step (global digests)."""
    out: dict[int, str] = {}
    acc: list[str] = []
    for r in steps:
        if r.samples is None or r.data_digest is None:
            break
        acc.append(r.data_digest)
        out[r.samples - (start_samples or 0)] = combine_digests(acc)
    return out


def _check_data_across(ctx: CheckContext, change: tuple[int, int]) -> CheckResult:
    b = ctx.boundary
    n = b.restored_step
    moved = f"DP {change[0]} -> {change[1]}"
    nums: Nums = {"dp": f"{change[0]} -> {change[1]}"}
    post = [r for r in b.post.steps if r.data_digest]
    pre = [b.pre[s] for s in sorted(b.pre) if s > n and b.pre[s].data_digest]
    if not post:
        return CheckResult(
            "data", Status.SKIP, f"{moved}: no batch digests logged after the resume", None, nums
        )
    if not all(is_global(r.data_digest) for r in post + pre):
        return CheckResult(
            "data",
            Status.SKIP,
            f"{moved}: per-rank batch digests cannot be compared across a change of DP size "
            "(log ckpt.data.global_digest(batch_ids) as data_digest)",
            None,
            nums,
        )
    at_n = b.pre.get(n)
    start = at_n.samples if at_n is not None else (ctx.facts.samples if ctx.facts is not None else None)
    # the next sample index: the first post step's count minus its own batch equals the count at N
    if start is not None and len(b.post.steps) > 1:
        p0, p1 = b.post.steps[0], b.post.steps[1]
        if p0.samples is not None and p1.samples is not None:
            resumed_at = p0.samples - (p1.samples - p0.samples)
            nums.update(restored_samples=start, resumed_at=resumed_at)
            if resumed_at != start:
                return _lost(
                    f"{moved}: the resumed run started at sample {resumed_at}, the checkpoint of step {n} "
                    f"stood at {start}",
                    nums,
                    Basis.CHECKPOINT if at_n is None else Basis.OVERLAP,
                )
    if not pre:
        return CheckResult(
            "data",
            Status.PASS if "resumed_at" in nums else Status.SKIP,
            f"{moved}: "
            + (
                "sample count continues from the restored step"
                if "resumed_at" in nums
                else "no pre-crash steps after the restored one to compare"
            ),
            None,
            nums,
        )
    post_w, pre_w = _windows(post, start), _windows(pre, start)
    common = sorted(set(post_w) & set(pre_w))
    if not common:  # no sample counts: steps of one global batch each, compared step by step
        pairs = [(r.step, b.pre[r.step].data_digest, r.data_digest) for r in post if r.step in b.pre]
        common_steps = [(s, a, c) for s, a, c in pairs if a]
        bad = [(s, a, c) for s, a, c in common_steps if a != c]
        nums["digests_compared"] = len(common_steps)
        if not common_steps:
            return CheckResult("data", Status.SKIP, f"{moved}: no overlapping global digests", None, nums)
        if bad:
            s, a, c = bad[0]
            nums.update(first_mismatch=s, mismatched=len(bad))
            return _lost(
                f"{moved}: step {s}: global batch digest {c} differs from the pre-crash {a} "
                f"({len(bad)}/{len(common_steps)} steps)",
                nums,
                Basis.OVERLAP,
            )
        return _same(
            f"{moved}: {count(len(common_steps), 'global batch digest')} equal to the pre-crash run", nums
        )
    nums["windows_compared"] = len(common)
    for seen in common:
        if post_w[seen] != pre_w[seen]:
            nums.update(first_mismatch_samples=seen)
            return _lost(
                f"{moved}: the first {seen} samples after step {n} differ from the pre-crash run's "
                f"(global digest {post_w[seen]} vs {pre_w[seen]})",
                nums,
                Basis.OVERLAP,
            )
    return _same(
        f"{moved}: the samples after step {n} equal the pre-crash run's ({len(common)} windows of global digests, "
        f"up to {common[-1]} samples)",
        nums,
    )


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


def _compared(
    triples: list[tuple[int, Any, Any]], noun: str, nums: Nums, key: str, checked: list[str]
) -> list[tuple[int, Any, Any]]:
    """The (step, pre-crash, resumed) ``triples`` whose values differ; how many were compared goes to ``nums[key]``
    and, counted as ``noun``, to the ``checked`` list of the PASS summary."""
    nums[key] = len(triples)
    checked.append(count(len(triples), noun))
    return [(s, a, c) for s, a, c in triples if a != c]


@_unless_dp_changed(_check_data_across)
def check_data(ctx: CheckContext) -> CheckResult:
    b = ctx.boundary
    pre = b.pre
    nums: Nums = {}
    pairs = [(r, pre[r.step]) for r in b.post.steps if r.step in pre]
    dd = [(r.step, p.data_digest, r.data_digest) for r, p in pairs if r.data_digest and p.data_digest]
    sm = [(r.step, p.samples, r.samples) for r, p in pairs if r.samples is not None and p.samples is not None]
    checked = []
    if dd:
        bad = _compared(dd, "batch digest", nums, "digests_compared", checked)
        if bad:
            s, a, c = bad[0]
            nums.update(first_mismatch=s, mismatched=len(bad))
            j = _earlier(ctx, "data_digest", c, s)
            extra = f"; its batch equals step {j}'s (samples repeated)" if j is not None else ""
            if j is not None:
                nums["repeats_step"] = j
            return _lost(
                f"step {s}: batch digest {c} differs from the pre-crash {a} "
                f"({len(bad)}/{len(dd)} steps){extra}",
                nums,
            )
    if sm:
        bad_s = _compared(sm, "sample count", nums, "samples_compared", checked)
        if bad_s:
            s, a, c = bad_s[0]
            nums.update(first_mismatch=s, pre_samples=a, post_samples=c)
            return _lost(f"step {s}: {c} samples consumed, {a} before the crash", nums)
    if not checked:
        # No overlap: the post batches must at least not repeat earlier ones, and the sample count must
        # continue from N by the usual per-step increment.
        first = b.post.steps[0]
        n = b.restored_step
        if first.data_digest:
            j = _earlier(ctx, "data_digest", first.data_digest, first.step)
            if j is not None:
                nums["repeats_step"] = j
                return _lost(f"step {first.step} consumed the batch of step {j} (samples repeated)", nums)
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
                return _lost(
                    f"step {first.step}: {first.samples} samples consumed, expected {expected}",
                    nums,
                )
            return CheckResult(
                "data", Status.PASS, "sample count continues from the restored step", None, nums
            )
        return CheckResult("data", Status.SKIP, "no overlapping data digests or sample counts", None, nums)
    return CheckResult("data", Status.PASS, " and ".join(checked) + " equal to the pre-crash run", None, nums)


def _rng_across(ctx: CheckContext, change: tuple[int, int]) -> CheckResult:
    """After a change of DP size per-rank streams are re-derived by design: say which, do not compare digests."""
    nums: Nums = {"dp": f"{change[0]} -> {change[1]}"}
    f = ctx.facts
    if f is None or f.rng_streams is None:
        why = "no checkpoint facts: which streams were carried is unknown"
        return CheckResult("rng", Status.SKIP, f"DP {change[0]} -> {change[1]}: {why}", None, nums)
    shared = [s for s in f.rng_streams if s in (f.rng_shared or ())]
    derived = [s for s in f.rng_streams if s not in shared]
    nums.update(carried=", ".join(shared) or None, derived=", ".join(derived) or None)
    return CheckResult(
        "rng",
        Status.SKIP,
        f"DP {change[0]} -> {change[1]}: RNG streams carried: {', '.join(shared) or 'none'}; re-derived from the "
        f"base seed, step and rank: {', '.join(derived) or 'none'} (per-step RNG digests do not compare)",
        None,
        nums,
    )


@_unless_dp_changed(_rng_across)
def check_rng(ctx: CheckContext) -> CheckResult:
    """The per-step RNG digests on the overlap (or a repeat of an earlier state without one), and the RNG after
    the restore against the state saved with the checkpoint (:func:`ckpt.resume.checks.saved.saved_rng`): a
    failure of either fails; the saved state decides where the steps alone cannot (no overlap)."""
    fact = saved_rng(ctx)
    steps = _rng_from_steps(ctx)
    if fact is None or steps.status is Status.FAIL:
        return steps
    if fact.status is Status.FAIL or steps.status is Status.SKIP or steps.confidence is Confidence.LOW:
        return fact
    steps.summary += f"; {fact.summary}"
    steps.numbers.update(fact.numbers)
    return steps


def _rng_from_steps(ctx: CheckContext) -> CheckResult:
    b = ctx.boundary
    pre = b.pre
    pairs = [(r.step, pre[r.step].rng_digest, r.rng_digest) for r in b.post.steps if r.step in pre]
    pairs = [(s, a, c) for s, a, c in pairs if a and c]
    if not pairs:
        return _rng_without_overlap(ctx)
    nums: Nums = {"compared": len(pairs)}
    bad = [(s, a, c) for s, a, c in pairs if a != c]
    if not bad:
        return CheckResult(
            "rng", Status.PASS, f"{count(len(pairs), 'RNG digest')} equal to the pre-crash run", None, nums
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
