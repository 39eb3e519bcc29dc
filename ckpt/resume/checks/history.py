"""Checks on the run's history rather than its values: lost work and environment drift."""

from __future__ import annotations

from ckpt.resume.checks.base import Cause, CheckResult, Status
from ckpt.resume.checks.context import CheckContext
from ckpt.resume.environment import NEURON_KEYS, VERSION_KEYS
from ckpt.words import count


def check_lost_work(ctx: CheckContext) -> CheckResult:
    """Fail when the resume used an older checkpoint than the newest one committed (save events)."""
    b = ctx.boundary
    n = b.restored_step
    crash = b.crash_step
    nums: dict[str, int | str | None] = {"restored_step": n, "crash_step": crash}
    if crash is not None:
        nums["steps_recomputed"] = max(0, crash - n)
    newest = b.newest_save
    if newest is None:
        return CheckResult("lost_work", Status.SKIP, "no save events before the resume", None, nums)
    nums.update(newest_save=newest.step, newest_save_path=newest.path)
    if n < newest.step:
        where = f" ({newest.path})" if newest.path else ""
        return CheckResult(
            "lost_work",
            Status.FAIL,
            f"restored step {n} although step {newest.step}{where} was committed: "
            f"{newest.step - n} extra steps recomputed",
            Cause.OLDER_CHECKPOINT,
            nums,
        )
    if n > newest.step and not b.inferred:
        return CheckResult(
            "lost_work",
            Status.WARN,
            f"restored step {n}, newer than any committed save ({newest.step})",
            Cause.UNCOMMITTED_CHECKPOINT,
            nums,
        )
    redone = count(crash - n, "step") if crash is not None and crash >= n else "? steps"
    return CheckResult(
        "lost_work",
        Status.PASS,
        f"restored the newest committed checkpoint (step {n}); {redone} recomputed",
        None,
        nums,
    )


def check_env(ctx: CheckContext) -> CheckResult:
    """Warn on version/world-size/determinism drift between the crashed and the resumed session (and the
    checkpoint's recorded env); a tokenizer change fails, since the data then means something else."""
    b = ctx.boundary
    if b.dead is None or b.dead.session is b.post.session:
        return CheckResult("env", Status.SKIP, "same process: no environment change possible")
    before, after = b.dead.env, b.post.env
    if not before or not after:
        return CheckResult("env", Status.SKIP, "no session environment logged")
    nums: dict[str, int | str | None] = {}
    changes: list[str] = []
    neuron = False
    sources = [("", before)] + ([("checkpoint ", dict(ctx.facts.env))] if ctx.facts and ctx.facts.env else [])
    for label, old in sources:
        for key in VERSION_KEYS:
            if key in old and key in after and old[key] != after[key]:
                changes.append(f"{label}{key} {old[key]} -> {after[key]}")
                nums[key] = f"{old[key]} -> {after[key]}"
                neuron = neuron or key in NEURON_KEYS
    for key, why in (("world_size", "data position must be re-split"), ("deterministic", "")):
        if before.get(key) is not None and after.get(key) is not None and before[key] != after[key]:
            changes.append(f"{key} {before[key]} -> {after[key]}" + (f" ({why})" if why else ""))
            nums[key] = f"{before[key]} -> {after[key]}"
    tok_old = before.get("tokenizer_id")
    tok_new = after.get("tokenizer_id")
    if tok_old is not None and tok_new is not None and tok_old != tok_new:
        nums["tokenizer_id"] = f"{tok_old} -> {tok_new}"
        return CheckResult(
            "env",
            Status.FAIL,
            f"tokenizer changed: {tok_old} -> {tok_new}"
            + (f"; also {', '.join(changes)}" if changes else ""),
            Cause.TOKENIZER_CHANGED,
            nums,
        )
    if changes:
        hint = "; expect recompilation on Neuron" if neuron or any(k in after for k in NEURON_KEYS) else ""
        hint = hint or (
            "; expect recompilation on Neuron" if any(c.startswith("torch ") for c in changes) else ""
        )
        return CheckResult("env", Status.WARN, ", ".join(changes) + hint, Cause.ENV_DRIFT, nums)
    host = (
        f" (host {before.get('hostname')} -> {after.get('hostname')})"
        if before.get("hostname") != after.get("hostname")
        else ""
    )
    return CheckResult("env", Status.PASS, "same versions, world size and tokenizer" + host, None, nums)
