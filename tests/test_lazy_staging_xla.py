"""Lazy staging under torch-xla on the CPU (PJRT_DEVICE=CPU), in a fresh process (tests/_lazy_xla.py): what
an in-place edit does to a held XLA tensor, and why XLA state is copied before ``save()`` returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_xla")
pytestmark = [pytest.mark.xla, pytest.mark.timeout(150)]

XLA_SCRIPT = Path(__file__).with_name("_lazy_xla.py")


def test_xla_aliases_follow_in_place_edits_so_lazy_falls_back_to_eager(tmp_path: Path) -> None:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    proc = subprocess.run(
        [sys.executable, str(XLA_SCRIPT), str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    # the premise: a detached alias and a view of an XLA tensor see a later in-place edit (functionalization)
    assert res["alias_after_edit"] == res["p_after_edit"] != res["p_before_edit"]
    assert res["view_after_edit"] == res["p_after_edit"][:2]
    # hence the saver copies XLA tensors before save() returns, says so, and the bytes are save-time ones
    assert res["lazy_bytes"] == 0 and "XLA" in res["reason"]
    assert res["saved"] == res["want"]
