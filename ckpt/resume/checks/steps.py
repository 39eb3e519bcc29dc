"""Step continuity: the first step after restoring N is N+1, and the checkpoint's counters say N too."""

from __future__ import annotations

from ckpt.resume.boundaries import Boundary
from ckpt.resume.checks.base import Cause, CheckResult, Status
from ckpt.resume.checks.context import CheckContext
from ckpt.words import count


def cadence(steps: list[int]) -> int:
    """The logging interval: the most common gap between consecutive logged steps (1 for every step).  A
    logger that writes every k-th step resumes its log at the next multiple of k, not at N+1."""
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False) if b > a]
    return max(set(gaps), key=gaps.count) if gaps else 1


def _expected_first(b: Boundary) -> int:
    """N+1, or with a logging interval k the first step after N on the pre-crash log's grid of steps."""
    n = b.restored_step
    pre = sorted(s for s in b.pre if s <= n)[-20:]
    k = cadence(pre)
    if k <= 1 or not pre:
        return n + 1
    return pre[-1] + k * ((n - pre[-1]) // k + 1)


def check_step(ctx: CheckContext) -> CheckResult:
    """Exact.  With a logged restore, the first step must be N+1 (the next logged step when the log keeps
    every k-th step).  Without one, the first step minus one should be a committed checkpoint (from save
    events); with neither, there is nothing to check."""
    b = ctx.boundary
    first = b.post.steps[0].step
    n = b.restored_step
    nums: dict[str, int | str | None] = {"restored_step": n, "first_step": first}
    if not b.inferred:
        want = _expected_first(b)
        if want != n + 1:
            nums["expected_first_step"] = want
        k = first - want
        if k > 0:
            return CheckResult(
                "step",
                Status.FAIL,
                f"resumed at step N+{first - n} = {first} after restoring {n}: {count(k, 'step')} skipped",
                Cause.STEPS_SKIPPED,
                nums,
            )
        if k < 0:
            return CheckResult(
                "step",
                Status.FAIL,
                f"resumed at step {first} after restoring {n}: {count(-k, 'step')} repeated",
                Cause.STEPS_REPEATED,
                nums,
            )
        return CheckResult("step", Status.PASS, f"restored {n}, first step {first}", None, nums)
    if not b.saved_steps:
        return CheckResult(
            "step", Status.SKIP, "no restore or save events: restore point unknown", None, nums
        )
    if n in b.saved_steps:
        return CheckResult(
            "step", Status.PASS, f"first step {first} follows the checkpoint of step {n}", None, nums
        )
    if n == 0:
        return CheckResult("step", Status.SKIP, "restarted from step 1 (see lost work)", None, nums)
    newest = max(b.saved_steps)
    nums["newest_save"] = newest
    if n > newest:
        return CheckResult(
            "step",
            Status.FAIL,
            f"resumed at step {first} but the newest checkpoint is step {newest}: {count(n - newest, 'step')} skipped",
            Cause.STEPS_SKIPPED,
            nums,
        )
    return CheckResult(
        "step",
        Status.WARN,
        f"resumed at step {first} but no checkpoint of step {n} was logged as committed",
        Cause.UNCOMMITTED_CHECKPOINT,
        nums,
    )


def check_counters(ctx: CheckContext) -> CheckResult:
    """Exact, from :class:`CheckpointFacts`: optimizer ``step`` counters and scheduler ``last_epoch`` equal N
    (one update / one scheduler step per optimizer step), samples consumed equal the log's count at N."""
    f = ctx.facts
    b = ctx.boundary
    n = b.restored_step
    live = b.restore.optimizer_step if b.restore is not None and not b.restore.inferred else None
    # The restore record holds the live optimizer's counter after the load: other than N, the state did not
    # arrive (whatever the checkpoint holds).
    lost = (
        (
            Cause.OPTIMIZER_LOST if live == 0 else Cause.COUNTER_MISMATCH,
            f"the optimizer's step counter after the restore is {live}, expected {n}",
        )
        if live is not None and live != n
        else None
    )
    if f is None and lost is not None:
        return CheckResult(
            "counters",
            Status.FAIL,
            lost[1],
            lost[0],
            {"restored_step": n, "optimizer_step_after_restore": live},
        )
    if f is None:
        return CheckResult("counters", Status.SKIP, "no checkpoint facts given")
    problems: list[tuple[Cause, str]] = []
    nums: dict[str, int | str | None] = {"restored_step": n, "checkpoint_step": f.step}
    where = b.restore.path if b.restore and b.restore.path else f"the checkpoint of step {n}"
    for entry in f.missing:
        problems.append((Cause.STATE_MISSING, f"{where} has no {entry}"))
    if lost is not None:
        problems.append(lost)
        nums["optimizer_step_after_restore"] = live
    if f.missing:
        nums["missing"] = ", ".join(m.split(" ")[0] for m in f.missing)
    if f.step != n:
        problems.append((Cause.COUNTER_MISMATCH, f"checkpoint is of step {f.step}, restore said {n}"))
    # Group parameters by counter value: a real model has hundreds of parameters, and one line per value
    # says the same with the numbers that decided it.
    by_value: dict[int, list[str]] = {}
    for name, value in (f.optimizer_steps or {}).items():
        by_value.setdefault(value, []).append(name)
    for value, names in sorted(by_value.items(), key=lambda kv: (kv[0] == n, kv[0])):
        label = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
        nums[f"optimizer_step[{label}]"] = value
        if value != n:
            cause = Cause.OPTIMIZER_LOST if value == 0 else Cause.COUNTER_MISMATCH
            problems.append((cause, f"optimizer {label!r} step counter is {value}, expected {n}"))
    if f.scheduler_last_epoch is not None:
        le = f.scheduler_last_epoch
        nums["scheduler_last_epoch"] = le
        if le in (0, -1) and n > 0:
            problems.append((Cause.WARMUP_RESTARTED, f"scheduler last_epoch is {le}, expected {n}"))
        elif abs(le - n) == 1:
            problems.append((Cause.LR_OFF_BY_ONE, f"scheduler last_epoch is {le}, expected {n}"))
        elif le != n:
            problems.append((Cause.LR_DIFFERENT, f"scheduler last_epoch is {le}, expected {n}"))
    if f.samples is not None:
        nums["checkpoint_samples"] = f.samples
        logged = b.pre.get(n)
        if logged is not None and logged.samples is not None:
            nums["logged_samples"] = logged.samples
            if logged.samples != f.samples:
                problems.append(
                    (
                        Cause.DATA_POSITION_LOST,
                        f"checkpoint has {f.samples} samples consumed, log says {logged.samples}",
                    )
                )
    tok = b.post.env.get("tokenizer_id")
    if f.tokenizer_id is not None and isinstance(tok, str) and _tokenizer_differs(f.tokenizer_id, tok):
        problems.append(
            (Cause.TOKENIZER_CHANGED, f"checkpoint tokenizer {f.tokenizer_id}, session uses {tok}")
        )
    if not problems:
        return CheckResult("counters", Status.PASS, f"checkpoint counters agree with step {n}", None, nums)
    cause, text = problems[0]
    more = (
        f" (+{len(problems) - 1} more: " + "; ".join(t for _, t in problems[1:]) + ")"
        if len(problems) > 1
        else ""
    )
    return CheckResult("counters", Status.FAIL, text + more, cause, nums)


def _hash_part(tokenizer_id: str) -> str | None:
    """The hex hash after the last ``@`` (``name@sha256[:16]``), or None for a free-form id."""
    _, sep, tail = tokenizer_id.rpartition("@")
    return (
        tail.lower() if sep and len(tail) >= 8 and all(c in "0123456789abcdefABCDEF" for c in tail) else None
    )


def _tokenizer_differs(checkpoint_id: str, session_id: str) -> bool:
    """Compare by file hash when both ids carry one (names may differ between machines), as strings when
    neither does; a free-form id (``"llama3@v1"``) cannot be compared with a hash, so that never alarms."""
    a, b = _hash_part(checkpoint_id), _hash_part(session_id)
    if a is None and b is None:
        return checkpoint_id != session_id
    if a is None or b is None:
        return False
    k = min(len(a), len(b))
    return a[:k] != b[:k]
