"""The second source of truth on a sample (``ckpt.resume.truth_trainer``; the grid is
``bench/verify_resume_truth.py --source trainer``, its table in docs/verify-resume.md): real
``transformers.Trainer`` runs of a tiny Llama on the Python docs tokenized by a BPE trained here, crashed 7 steps
after checkpoint N and resumed with ``resume_from_checkpoint`` by a fresh Trainer, one defect planted per branch,
judged through the Trainer's own TensorBoard events and through ``CkptCallback``'s ledger with the checkpoints'
facts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
os.environ.setdefault("USE_TORCH_XLA", "0")

from ckpt.resume.checks import Cause  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# seed 1: cosine, N = 30; seed 2: cosine_with_restarts whose warm restart is at N = 40; seed 14:
# warmup_stable_decay with gradient accumulation 2, the decay starting at N = 40
SAMPLE = {
    1: ("clean", "clean_nondeterministic", "weights_stale_saved", "scheduler_lost", "optimizer_reset",
        "moments_zeroed", "data_restarted", "accumulation_changed"),
    2: ("clean",),
    14: ("clean",),
}  # fmt: skip


_MEASURE = """
import json, sys
from pathlib import Path
from ckpt.resume.truth_trainer import TrainerTruthConfig, measure
cfg = TrainerTruthConfig.from_seed(int(sys.argv[1]), overlap=True)
json.dump(measure(cfg, Path(sys.argv[2]), tuple(sys.argv[4:])), open(sys.argv[3], "w"))
"""


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    # each seed's Trainer runs in a fresh process: in a pytest process where earlier tests used the XLA device,
    # the autograd engine's device queues no longer match the CPU-only Trainer's (an internal assert)
    out: list[dict] = []
    env = dict(os.environ, USE_TORCH_XLA="0")
    for seed, defects in SAMPLE.items():
        work = tmp_path_factory.mktemp(f"trainer-{seed}")
        dst = work / "rows.json"
        cmd = [sys.executable, "-c", _MEASURE, str(seed), str(work), str(dst), *defects]
        subprocess.run(cmd, env=env, check=True, timeout=600)
        out += json.loads(dst.read_text())
    return out


def _pick(rows: list[dict], defect: str, fmt: str, det: bool | None, seed: int = 1) -> dict:
    return next(
        r
        for r in rows
        if (r["defect"], r["format"], r["deterministic"], r["seed"]) == (defect, fmt, det, seed)
    )


def test_the_sample_covers_schedulers_accumulation_and_events_at_the_boundary(rows: list[dict]) -> None:
    assert {r["scheduler"] for r in rows} == {"cosine", "cosine_with_restarts", "warmup_stable_decay"}
    assert {r["accumulation"] for r in rows if r["seed"] == 14} == {2}
    assert {r["seed"] for r in rows if r["event_at_boundary"]} == {2, 14}


def test_clean_resumes_pass_in_every_view_warm_restarts_and_decay_starts_included(rows: list[dict]) -> None:
    bad = [
        (r["seed"], r["scheduler"], r["format"], r["deterministic"], r["causes"])
        for r in rows
        if r["defect"] == "clean"
        or (r["defect"] == "clean_nondeterministic" and r["deterministic"] is not True)
        if r["exit"] != 0
    ]
    assert bad == []


def test_forced_bitwise_on_a_nondeterministic_trainer_run_names_no_cause_without_a_fact(
    rows: list[dict],
) -> None:
    r = _pick(rows, "clean_nondeterministic", "tensorboard", True)
    assert r["exit"] == 1 and Cause.OPTIMIZER_LOST.value not in r["causes"]


def test_weights_and_schedules_are_caught_in_every_view(rows: list[dict]) -> None:
    for fmt, det in (("tensorboard", False), ("tensorboard", True), ("ledger", None)):
        assert _pick(rows, "weights_stale_saved", fmt, det)["exit"] == 1
        sched = _pick(rows, "scheduler_lost", fmt, det)
        assert sched["exit"] == 1 and Cause.WARMUP_RESTARTED.value in sched["causes"]


def test_optimizer_and_data_defects_are_named_from_the_ledgers_facts(rows: list[dict]) -> None:
    assert Cause.OPTIMIZER_LOST.value in _pick(rows, "optimizer_reset", "ledger", None)["causes"]
    assert Cause.DATA_POSITION_LOST.value in _pick(rows, "data_restarted", "ledger", None)["causes"]
    accum = _pick(rows, "accumulation_changed", "ledger", None)  # 1 -> 2: two batches a step
    assert accum["exit"] == 1 and Cause.DATA_POSITION_LOST.value in accum["causes"]
    # moments zeroed with the step kept: the live counter says restored, so bitwise names the symptom
    moments = _pick(rows, "moments_zeroed", "ledger", None)
    assert moments["exit"] == 1 and Cause.OPTIMIZER_LOST.value not in moments["causes"]
    assert Cause.LOSS_DIVERGED.value in moments["causes"]
