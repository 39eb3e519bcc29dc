"""Issue 37 item 5: Ctrl-C (SIGINT to the process group, as a terminal sends it) or ``kill`` (SIGTERM to the
process) at many moments of a real ``ckpt convert --format dcp --workers 2``.

Before: a 57-line traceback and exit 1 in some runs, a process still there 120 s after SIGINT in another, and
SIGTERM killed the command mid-write, leaving its staging folder.  Now every moment ends in exit 130 and one line:
``ckpt: interrupted`` with nothing left next to DST, or, when the signal landed after the commit, a line saying
DST is complete (and it is).  The moments are found by watching the files the conversion writes, not by timing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_helpers import FIX

pytestmark = pytest.mark.timeout(300)

#: (signal, when): "start" (imports), "staging" (the hidden staging folder appeared), "data" (a worker's data file
#: is there), "committed" (DST appeared)
MOMENTS = [
    ("SIGINT", "start"),
    ("SIGTERM", "start"),
    ("SIGINT", "staging"),
    ("SIGTERM", "staging"),
    ("SIGINT", "data"),
    ("SIGTERM", "data"),
    ("SIGINT", "committed"),
    ("SIGTERM", "committed"),
]


def _reached(when: str, parent: Path, dst: Path, started: float) -> bool:
    staging = list(parent.glob(f".{dst.name}.tmp-*"))
    if when == "start":
        return time.monotonic() - started > 0.5
    if when == "staging":
        return bool(staging) or dst.exists()
    if when == "data":
        return any(s.glob("*distcp*") for s in staging) or dst.exists()
    return dst.exists()


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src") / "hf"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):
        (src / name).write_bytes((FIX / name).read_bytes())
    return src


def _interrupt(src: Path, parent: Path, sig: str, when: str) -> tuple[int, str]:
    dst = parent / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt", "convert", str(src), str(dst), "--to", "cuda", "--format", "dcp",
         "--workers", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PJRT_DEVICE": "CPU"},
        start_new_session=True,
    )  # fmt: skip
    try:
        started = time.monotonic()
        while proc.poll() is None and not _reached(when, parent, dst, started):
            time.sleep(0.005)
        if proc.poll() is None:
            if sig == "SIGINT":
                os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the group
            else:
                proc.send_signal(signal.SIGTERM)  # ``kill PID``: the command only
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err


def test_a_signal_at_any_moment_ends_in_one_line_and_nothing_half_written(hf_src: Path, tmp_path: Path) -> None:
    outcomes = []
    for i, (sig, when) in enumerate(MOMENTS):
        parent = tmp_path / f"run{i}"
        parent.mkdir()
        code, err = _interrupt(hf_src, parent, sig, when)
        dst = parent / "out"
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if code == 0:  # it finished before the signal was sent: the whole output
            assert when == "committed", err[-3000:]
            outcomes.append("finished")
        else:
            assert code == 130 and len(lines) == 1, (sig, when, code, err[-3000:])
            if lines[0] == "ckpt: interrupted":
                outcomes.append("interrupted")
            else:
                assert lines[0] == f"ckpt: interrupted; DST {dst} was already committed and is complete", lines
                outcomes.append("complete")
        if outcomes[-1] == "interrupted":
            assert os.listdir(parent) == [], (sig, when, os.listdir(parent))  # no DST, no staging folder
        else:
            assert sorted(os.listdir(parent)) == ["out"], os.listdir(parent)
            assert (dst / ".metadata").is_file() and {p.name for p in dst.iterdir()} == {
                ".metadata", "__0_0.distcp", "__1_0.distcp"
            }
    # the moments before the commit were all interrupted (the others may have finished first)
    assert outcomes[:4] == ["interrupted"] * 4, outcomes
