"""``check_continuation``: N steps straight vs K steps + save + fresh-process restore + N-K steps.

The training functions live at module level, as a user's must, so the spawned processes can import them.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt.resume.checks import Cause
from ckpt.resume.continuity import Continuation, ContinuationError, check_continuation
from ckpt.resume.ledger import digest_ids, digest_rng


class Loader:
    def __init__(self) -> None:
        self.pos = 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.pos // 8)
        ids = torch.randperm(64, generator=g)[(self.pos % 8) * 8 : (self.pos % 8 + 1) * 8]
        self.pos += 1
        return ids

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = int(state["pos"])


def _train(
    c: Continuation, *, restore_scheduler: bool = True, restore_rng: bool = True, clock_seed: bool = False
) -> None:
    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    y = x.sum(1, keepdim=True).sin()
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 4))
    loader = Loader()
    state = {"model": model, "optimizer": opt, "scheduler": sched, "dataloader": loader}
    restore = dict(state) if restore_scheduler else {k: v for k, v in state.items() if k != "scheduler"}
    if clock_seed:  # the dropout RNG of a fresh run differs from run to run
        torch.manual_seed(time.perf_counter_ns())
    start = c.restore(rng=restore_rng, **restore)
    for step in range(start, c.stop_at + 1):
        rng = digest_rng()
        ids = loader.next()
        loss = torch.nn.functional.mse_loss(model(x[ids]), y[ids])
        opt.zero_grad()
        loss.backward()
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        c.ledger.step(step, loss, lr, samples=loader.pos * 8, data_digest=digest_ids(ids), rng_digest=rng)
        c.save_if_due(step, progress={"samples": loader.pos * 8}, **state)


def train_ok(c: Continuation) -> None:
    _train(c)


def train_forgets_scheduler(c: Continuation) -> None:
    _train(c, restore_scheduler=False)


def train_unseeded(c: Continuation) -> None:
    """Seeds the dropout RNG from the clock: not reproducible even without a resume (the restore is right)."""
    _train(c, clock_seed=True)


def train_crashes(c: Continuation) -> None:
    raise RuntimeError("cannot find my data")


def test_correct_training_function_continues_exactly(tmp_path: Path) -> None:
    result = check_continuation(train_ok, steps=10, split=4, workdir=tmp_path)
    result.assert_continuous()
    v = result.verdict
    assert v.deterministic and v.boundary.restored_step == 4 and v.boundary.overlap == list(range(5, 11))
    assert {c.name: c.status.value for c in v.checks} == {
        "step": "pass",
        "counters": "pass",  # from the split run's checkpoint manifest
        "lr": "pass",
        "data": "pass",
        "position": "pass",  # the sample counts equal the straight run's
        "rng": "pass",
        "env": "pass",
        "weights": "pass",  # the restore event's model digest equals the checkpoint's
        "optimizer": "skip",  # the manager's restore record holds no optimizer summary; bitwise decides
        "loss": "pass",
    }
    assert "=" in result.report()


def test_forgotten_scheduler_is_named_and_the_assertion_shows_why(tmp_path: Path) -> None:
    result = check_continuation(train_forgets_scheduler, steps=10, split=6, workdir=tmp_path)
    assert not result.ok and result.causes == [Cause.WARMUP_RESTARTED]
    with pytest.raises(AssertionError, match="warmup restarted"):
        result.assert_continuous()


def test_a_failing_training_function_is_reported_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(
        ContinuationError, match="failed in the straight process: RuntimeError: cannot find my data"
    ) as e:
        check_continuation(train_crashes, steps=4, split=2, workdir=tmp_path)
    assert "Traceback" in e.value.details
    with pytest.raises(ContinuationError, match="split=4 must lie strictly between"):
        check_continuation(train_ok, steps=4, split=4, workdir=tmp_path)


def test_an_unreproducible_run_is_named_before_blaming_the_rng(tmp_path: Path) -> None:
    # The RNG is restored correctly; the run just is not reproducible from its start (clock-seeded dropout).
    result = check_continuation(train_unseeded, steps=6, split=3, workdir=tmp_path)
    assert result.baseline_mismatch == 1 and not result.ok
    assert result.causes == [Cause.NOT_REPRODUCIBLE]
    assert Cause.RNG_NOT_RESTORED not in result.causes
    assert "not reproducible without a resume" in result.report()


def test_a_second_call_with_the_same_workdir_runs_again(tmp_path: Path) -> None:
    check_continuation(train_ok, steps=5, split=2, workdir=tmp_path).assert_continuous()
    check_continuation(train_ok, steps=5, split=2, workdir=tmp_path).assert_continuous()
