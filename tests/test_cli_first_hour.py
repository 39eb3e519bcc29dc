"""Issue 18, "a user's first hour": what a new user hits after the happy paths, each through the real command.

Every refusal is one ``ckpt: error:`` line with exit code 2, no traceback, nothing written at the destination.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ckpt
from tests.cli_helpers import FIX, assert_one_error, ckpt_cli, tree

TAG = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
CONFIG = FIX / "config.json"

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------------------------------ 2: URLs


@pytest.mark.parametrize("dst", ["s3:/bucket/out", "s3:bucket/out", "gs:/b/x"])
@pytest.mark.parametrize("fmt", ["hf", "ckpt"])
def test_a_url_missing_a_slash_is_refused_not_written_locally(tmp_path: Path, dst: str, fmt: str) -> None:
    """``s3:/bucket/out`` is a valid local path; writing there would "succeed" into a folder named ``s3:``."""
    r = ckpt_cli("convert", TAG, dst, "--to", "cuda", "--format", fmt, "--config", CONFIG, cwd=tmp_path)
    scheme = dst.split(":", 1)[0]
    assert_one_error(r, dst, f"{scheme}://")
    assert tree(tmp_path) == {}


def test_the_library_refuses_a_mangled_url_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ckpt.CkptError, match="slash missing"):
        ckpt.CheckpointManager("s3:/bucket/run")
    assert tree(tmp_path) == {}
