"""``ckpt ls`` / ``ckpt inspect`` on NxD folders: tags by step with complete / unmarked / incomplete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ckpt.cli.main import cli
from click.testing import CliRunner

TAG = (
    Path(__file__).resolve().parent.parent
    / "fixtures"
    / "nxd"
    / "llama_gqa_h64"
    / "nxd_train_tp2_dp2_zero1_xser"
    / "step_3"
)


def test_ls_lists_nxd_tags_by_step_with_status(tmp_path: Path) -> None:
    for name in ("step_10", "step_3", "step_2"):
        shutil.copytree(TAG, tmp_path / name)
    (tmp_path / "step_10" / "done").unlink()
    (tmp_path / "step_2" / "done").unlink()
    (tmp_path / "step_2" / "optim" / "dp_rank_01_tp_rank_00_pp_rank_00.pt").unlink()
    res = CliRunner().invoke(cli, ["ls", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert [(r["tag"], r["status"]) for r in rows] == [
        ("step_2", "incomplete"),
        ("step_3", "complete"),
        ("step_10", "unmarked"),
    ]
    assert rows[1]["tp"] == 2 and rows[1]["dp"] == 2 and rows[1]["xser"] is True
    assert "dp 1 tp 0" in rows[0]["problems"][0]
    table = CliRunner().invoke(cli, ["ls", str(tmp_path)])
    assert table.exit_code == 0 and "unmarked" in table.output and "(NxD)" in table.output


def test_inspect_nxd_tag() -> None:
    res = CliRunner().invoke(cli, ["inspect", str(TAG), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert (doc["tp"], doc["dp"], doc["zero1"], doc["xser"], doc["status"]) == (2, 2, True, True, "complete")
    assert doc["ranks"]["tp0_pp0_ep0"][1] == ["model.layers.0.self_attn.qkv_proj.weight_q", [32, 64]]
    text = CliRunner().invoke(cli, ["inspect", str(TAG)])
    assert text.exit_code == 0 and "NxD tag step_3" in text.output
