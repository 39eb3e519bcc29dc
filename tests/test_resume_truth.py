"""Ground truth on a sample of the generator's runs (``ckpt.resume.truth``; the full grid is
``bench/verify_resume_truth.py`` and its table is in docs/verify-resume.md): real tiny runs, crashed and
restored through ``CheckpointManager`` with one defect planted each, logged as TensorBoard events and as the
ledger, every step and every 5th step.  Each class must get its verdict in the views where the docs say it is
visible, and every clean class must pass everywhere."""

from __future__ import annotations

import pytest

from ckpt.resume.truth import CLEAN, DEFECTS, TruthConfig, measure

pytestmark = pytest.mark.timeout(600)

SEEDS = (1, 2)  # checkpoints at step 80 and 100 of 160 (middle and late: low LR, flat loss)
# defect -> (overlap modes, views as (format, every, --deterministic)) where it must be detected
ALL_VIEWS = {("tensorboard", e, d) for e in (1, 5) for d in (False, True)} | {
    ("ledger", e, None) for e in (1, 5)
}
LEDGER = {("ledger", e, None) for e in (1, 5)}
EXPECT: dict[str, dict[bool, set[tuple[str, int, bool | None]]]] = {
    "weights_fresh": {True: ALL_VIEWS, False: ALL_VIEWS},
    # without overlap: logs alone cannot see it (see docs); the ledger's save-time weight fingerprint does
    "weights_stale": {True: ALL_VIEWS - {("tensorboard", 5, False)}, False: LEDGER},
    # the previous checkpoint's weights: the ledger's checkpoint facts show it even without overlap
    "weights_stale_saved": {True: ALL_VIEWS - {("tensorboard", 5, False)} | LEDGER, False: LEDGER},
    "lr_halved": {True: ALL_VIEWS, False: {v for v in ALL_VIEWS if v[1] == 1}},
    "scheduler_lost": {True: ALL_VIEWS, False: ALL_VIEWS},
    "lr_off_by_one": {True: ALL_VIEWS, False: {v for v in ALL_VIEWS if v[1] == 1}},
    "optimizer_reset": {True: {("tensorboard", 1, True), ("tensorboard", 5, True)} | LEDGER, False: LEDGER},
    "data_reset": {True: {("tensorboard", 1, True), ("tensorboard", 5, True)} | LEDGER, False: LEDGER},
    # without overlap: the RNG digests of the save and the restore events
    "rng_lost": {True: {("tensorboard", 1, True), ("tensorboard", 5, True)} | LEDGER, False: LEDGER},
    "older_checkpoint": {True: LEDGER, False: LEDGER},
}


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out: list[dict] = []
    for seed in SEEDS:
        for overlap in (True, False):
            root = tmp_path_factory.mktemp(f"truth-{seed}-{overlap}")
            out += measure(TruthConfig(size="small", seed=seed, overlap=overlap), root)
    return out


def _view(r: dict) -> tuple[str, int, bool | None]:
    return r["format"], r["every"], r["deterministic"]


def test_clean_restarts_pass_in_every_view(rows: list[dict]) -> None:
    bad = [
        (r["defect"], r["seed"], r["overlap"], _view(r), r["causes"])
        for r in rows
        if r["defect"] in CLEAN
        and r["exit"] != 0
        and not (r["defect"] == "clean_nondeterministic" and r["deterministic"] is True)
    ]
    assert bad == []
    # --deterministic forced on a run that is not bitwise reproducible fails, as it must
    forced = [
        r for r in rows if r["defect"] == "clean_nondeterministic" and r["deterministic"] and r["every"] == 1
    ]
    assert any(r["exit"] == 1 for r in forced if r["overlap"])


@pytest.mark.parametrize("defect", sorted(EXPECT))
def test_defect_is_detected_where_the_docs_say(rows: list[dict], defect: str) -> None:
    assert set(EXPECT) | CLEAN == set(DEFECTS)
    missed = [
        (r["seed"], r["overlap"], _view(r), r["causes"])
        for r in rows
        if r["defect"] == defect and _view(r) in EXPECT[defect][r["overlap"]] and r["exit"] != 1
    ]
    assert missed == []


def test_no_defect_is_blamed_on_the_optimizer_without_facts(rows: list[dict]) -> None:
    # "optimizer state lost" needs a fact: bitwise overlap with the first loss exact (or checkpoint counters)
    blamed = {
        r["defect"]
        for r in rows
        if "optimizer state lost" in r["causes"] and r["format"] == "tensorboard" and not r["deterministic"]
    }
    assert blamed == set()
