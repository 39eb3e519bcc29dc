"""Crash consistency, small: SIGKILL a checkpointing training process at random moments and restart it.

The full run (>= 100 local trials, >= 20 on S3) is ``bench/torture_crash.py``; its figures are in
docs/reliability.md. Here 8 local and 3 S3 trials keep the suite fast while still killing real processes
mid-save (the trainer saves asynchronously every step, so most kills land inside a background write).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import REAL_S3_URL
from torture.crash import CrashReport, run_trials

pytestmark = pytest.mark.timeout(300)


def check(report: CrashReport, trials: int) -> None:
    assert report.problems == []
    assert report.corrupt_restores == 0
    assert report.divergent_losses == 0
    assert report.trials == trials and report.restores == trials + 1
    assert report.restores_from_scratch == 1  # only the very first start has nothing to restore
    assert report.kills_during_save >= 1  # the kills did land inside saves
    assert report.final_step > trials  # training progressed across restarts
    assert all(lost >= 0 for lost in report.lost_steps)


def test_sigkill_during_async_saves_local(tmp_path: Path) -> None:
    report = run_trials(str(tmp_path / "run"), str(tmp_path), 8, seed=6, max_delay=1.0)
    check(report, 8)


def test_sigkill_with_the_writer_process_local(tmp_path: Path) -> None:
    """The same with ProcessStager: no corrupt restore, and every writer process died with its trainer."""
    report = run_trials(str(tmp_path / "run"), str(tmp_path), 4, seed=6, max_delay=1.0, process_writer=True)
    check(report, 4)
    assert report.writers_left == 0


def test_sigkill_during_async_saves_with_the_local_tier(tmp_path: Path) -> None:
    # every step to the local tier (its background half: commit into a hidden folder, rename, retention), every
    # third also copied to the persistent root: kills land in either
    report = run_trials(
        str(tmp_path / "run"), str(tmp_path), 6, seed=7, max_delay=1.0,
        local_dir=str(tmp_path / "local"), persist_every=3,
    )  # fmt: skip
    check(report, 6)


def test_sigkill_during_saves_to_the_memory_tier(tmp_path: Path, shm_dir: Path) -> None:
    # the host-memory tier (/dev/shm): kills land in the copy into the arena, its in-place seal and link, the
    # commit, an arena's reuse, or the background copy to the root every third step; a restart adopts the newest
    # step from memory, never a half-written one
    report = run_trials(
        str(tmp_path / "run"), str(tmp_path), 3, seed=8, max_delay=1.5,
        local_dir=str(shm_dir), persist_every=3, local_memory=True,
    )  # fmt: skip
    # as check(), but a kill may land before the first step is committed (the memory tier's first save also makes
    # its arenas): then two starts restore nothing, consistently
    assert report.problems == [] and report.corrupt_restores == 0 and report.divergent_losses == 0
    assert report.trials == 3 and report.restores == 4
    assert report.restores_from_scratch < report.restores  # some restart did restore a step from memory
    assert report.kills_during_save >= 1 and report.final_step > 3


@pytest.mark.s3
@pytest.mark.skipif(bool(REAL_S3_URL), reason="trainer processes are pointed at the loopback moto server")
def test_sigkill_during_async_saves_s3(s3: Any, tmp_path: Path) -> None:
    report = run_trials(s3.url, str(tmp_path), 3, seed=6, endpoint=s3.endpoint, max_delay=1.0)
    check(report, 3)
    assert report.open_multipart_uploads == 0
