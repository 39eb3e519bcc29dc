"""Crash consistency of ``ckpt convert``, small: SIGKILL real conversions (ckpt, ckpt --workers 2, hf, dcp, nxd)
at seeded random moments; DST must hold nothing valid-looking (or exactly the reference output, when the kill
landed after the commit) and SRC must be byte-identical.  The full run is ``bench/torture_convert.py``; its figures
are in docs/reliability.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torture.convert_crash import CASES, ConvertCrashReport, make_source, run_trials

pytestmark = pytest.mark.timeout(600)


def test_killed_conversions_leave_nothing_valid_looking(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    report: ConvertCrashReport = run_trials(src, tmp_path, 3, seed=3)
    assert report.problems == []
    assert report.corrupt == 0 and report.src_changed == 0
    assert report.trials == 3 * len(CASES)
    assert report.nothing_valid + report.complete_and_equal == report.trials
    assert report.killed_while_writing >= 1  # some kills did land inside a conversion's output
