"""The README's demo command, end to end, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_runs_end_to_end(tmp_path):
    workdir = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "ckpt", "demo", "--dir", str(workdir), "--steps", "12", "--kill-at", "8"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resume is bit-exact" in r.stdout
    assert "CONTINUOUS" in r.stdout
    assert "bit-identical" in r.stdout and "round trip" in r.stdout
    assert (workdir / "crashed" / "resume.png").stat().st_size > 0
    assert (workdir / "crashed" / "converted-neuron-tp2" / "manifest.json").exists()
