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


# ------------------------------------------------------------------------------------------------ 3: NxD step


def test_an_nxd_tags_step_comes_from_its_contents_not_its_name(tmp_path: Path) -> None:
    """``run7`` holding a step-3 tag (``user_content.pt`` total_steps=3, ``scheduler.pt`` last_epoch=3) is step 3
    in ``inspect``, ``ls`` and the converted manifest; the disagreeing name is one warning line naming all."""
    import json
    import shutil

    tag = tmp_path / "runs" / "run7"
    shutil.copytree(TAG, tag)
    r = ckpt_cli("inspect", tag, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step"] == 3
    (warning,) = r.stderr.splitlines()
    assert warning.startswith("ckpt: warning: ") and "total_steps=3" in warning and "'run7'" in warning
    listed = ckpt_cli("ls", tag.parent, "--json")
    assert [row["step"] for row in json.loads(listed.stdout)] == [3], listed.stderr
    dst = tmp_path / "cuda"
    conv = ckpt_cli("convert", tag, dst, "--to", "cuda", "--config", CONFIG)
    assert conv.returncode == 0, conv.stderr
    assert ckpt.open_checkpoint(str(dst)).manifest.step == 3
    assert "'run7'" in conv.stderr and "Traceback" not in conv.stderr


def test_agreeing_sources_give_no_warning_and_a_bare_tag_falls_back_to_its_name(tmp_path: Path) -> None:
    import shutil
    import warnings

    from ckpt.converters.nxd.files import scan_tag
    from ckpt.converters.nxd.step import step_sources, tag_step

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        files = scan_tag(TAG)
        assert tag_step(files) == 3
        assert [v for _, v in step_sources(files)] == [3, 3, 3]
    bare = tmp_path / "step_12"
    shutil.copytree(TAG, bare)
    (bare / "user_content.pt").unlink()
    (bare / "scheduler.pt").unlink()
    assert tag_step(scan_tag(bare)) == 12
