"""The restore record's facts (``ckpt.resume.restore_facts``): the LRs a checkpoint's scheduler state gives when
replayed through the live scheduler's class, and the live optimizer's settings and moments."""

from __future__ import annotations

import pytest
import torch

from ckpt.resume.restore_facts import optimizer_summary, replay_scheduler

transformers = pytest.importorskip("transformers")


def _adamw() -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=1.0, betas=(0.9, 0.99), weight_decay=0.1)


def _run(make, steps: int) -> tuple[list[float], object]:
    opt = _adamw()
    sched = make(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return lrs, sched


@pytest.mark.parametrize(
    "make",
    [
        lambda o: transformers.get_scheduler(
            "cosine_with_restarts", o, num_warmup_steps=2, num_training_steps=30,
            scheduler_specific_kwargs={"num_cycles": 3},
        ),
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=8, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[9, 12], gamma=0.1),
    ],
    ids=["cosine_with_restarts", "StepLR", "MultiStepLR"],
)  # fmt: skip
def test_the_checkpoints_scheduler_replayed_gives_the_runs_own_lrs_warm_restarts_and_milestones_included(
    make,
) -> None:
    full, _ = _run(make, 30)
    _, at_8 = _run(make, 8)  # the checkpoint of step 8
    template = make(_adamw())  # what the resumed job built, before the load
    for _ in range(3):
        template.step()  # a live scheduler stepped further (a defect) does not change the replay
    assert replay_scheduler(template, at_8.state_dict(), 12) == full[8:20]


def test_a_metric_driven_scheduler_is_not_replayed() -> None:
    opt = _adamw()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    assert replay_scheduler(plateau, plateau.state_dict()) is None


def test_optimizer_summary_holds_the_settings_and_sees_zeroed_moments() -> None:
    opt = _adamw()
    assert optimizer_summary(opt) == {
        "hyper": [{"betas": [0.9, 0.99], "weight_decay": 0.1, "eps": 1e-8, "amsgrad": False}],
        "exp_avg_norm": None,  # no update yet: no moments
    }
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.full_like(p, 2.0)
    opt.step()
    assert optimizer_summary(opt)["exp_avg_norm"] == pytest.approx(0.2 * 3**0.5)
    for st in opt.state.values():
        st["exp_avg"].zero_()
    assert optimizer_summary(opt)["exp_avg_norm"] == 0.0
