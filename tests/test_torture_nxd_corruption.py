"""NxD-native files in the corruption matrix: damage one rank file of a copied NxD training tag, then read it
(``read_tag``), import it (``import_tag``) and run ``ckpt inspect`` / ``ckpt ls`` on it.

Only what is detected is asserted here; docs/reliability.md lists what is not (NxD rank files carry no checksum of
their own, and torch.load does not verify the zip CRC32s: a flipped byte inside tensor data, or two swapped TP rank
files of equal shapes, read back without an error).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt.converters.convert import load_config
from ckpt.converters.nxd import import_tag, read_tag

from ckpt.errors import CkptError

pytestmark = pytest.mark.timeout(300)

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"
TAG = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
VICTIM = "model/dp_rank_00_tp_rank_01_pp_rank_00.pt"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpt", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture()
def tag(tmp_path: Path) -> Path:
    out = tmp_path / "run" / "step_3"
    shutil.copytree(TAG, out)
    return out


def test_truncated_rank_file_is_named_everywhere(tag: Path, tmp_path: Path) -> None:
    victim = tag / VICTIM
    victim.write_bytes(victim.read_bytes()[:-300])
    with pytest.raises(CkptError) as info:
        read_tag(tag)
    assert VICTIM.split("/")[1] in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(CkptError) as info:
        import_tag(tag, str(tmp_path / "imported"), config=load_config(str(FIX / "config.json")))
    assert VICTIM.split("/")[1] in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "imported" / "manifest.json").exists()
    r = cli("inspect", str(tag))
    assert r.returncode != 0 and VICTIM.split("/")[1] in r.stderr and "Traceback" not in r.stderr
    r = cli("ls", str(tag.parent))
    assert r.returncode == 0 and "truncated" in r.stdout and "Traceback" not in r.stderr


def test_deleted_rank_file_is_refused_on_import_and_shown_by_ls(tag: Path, tmp_path: Path) -> None:
    (tag / VICTIM).unlink()
    with pytest.raises(CkptError, match="model file of tp 1 pp 0 ep 0 missing"):
        import_tag(tag, str(tmp_path / "imported"), config=load_config(str(FIX / "config.json")))
    assert not (tmp_path / "imported" / "manifest.json").exists()
    r = cli("ls", str(tag.parent))
    assert r.returncode == 0 and "missing" in r.stdout
