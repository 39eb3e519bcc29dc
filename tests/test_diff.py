"""``ckpt diff A B`` / ``ckpt.diff()``: checkpoints in any formats compared tensor by tensor through the engine.

Inputs are real: NxD's own training tag (TP 2, ZeRO-1 over DP 2) and the HF model it was made from
(``fixtures/nxd/llama_gqa_h64``), ``ckpt convert``'s outputs from it (HF folder, our format, DCP), and the PEFT
adapter made with PEFT's ``LoraConfig`` (``fixtures/nxd_lora``) against the NxD LoRA tag converted from it.  The CLI
runs in a subprocess as a user runs it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from ckpt.cli.main import cli
from ckpt.converters.convert import ConvertOptions, convert
from cli_helpers import FIX, ROOT, assert_one_error, ckpt_cli
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import ckpt

TAG = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
LORA = ROOT / "fixtures" / "nxd_lora"
PLANTED = "model.layers.1.self_attn.k_proj.weight"


def run(*args: object):  # noqa: ANN201 - click's Result
    """``ckpt ARGS`` in this process (the subprocess form, :func:`ckpt_cli`, is used where the user flow matters)."""
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def outs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tag converted (unmeasured) to an HF folder, our format and DCP; and the fixture's ground truth HF folder."""
    root = tmp_path_factory.mktemp("diff")
    cfg = json.loads((FIX / "config.json").read_text())
    out = {"truth": root / "truth"}
    out["truth"].mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(FIX / f, out["truth"] / f)
    for fmt in ("hf", "ckpt"):
        out[fmt] = root / fmt
        with pytest.warns(UserWarning) if fmt == "hf" else _nothing():  # HF: "not written: optimizer ..."
            convert(str(TAG), str(out[fmt]), ConvertOptions(to="cuda", format=fmt, config=cfg))
    out["dcp"] = root / "dcp"
    convert(str(out["ckpt"]), str(out["dcp"]), ConvertOptions(to="cuda", format="dcp"))
    return out


def _nothing():  # noqa: ANN202
    import contextlib

    return contextlib.nullcontext()


def _edited(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001 - a function of the tensor dict
    shutil.copytree(src, dst)
    (shard,) = dst.glob("*.safetensors")
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.is_file():  # as a tool that edits a model writes it: the index agrees with the shard (issue 37)
        doc = json.loads(index.read_text())
        doc["weight_map"] = {n: shard.name for n in tensors}
        index.write_text(json.dumps(doc))
    return dst


def test_nxd_tag_equals_the_hf_model_it_was_converted_to(outs: dict[str, Path]) -> None:
    r = ckpt_cli("diff", TAG, outs["hf"], "--config", outs["hf"] / "config.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "equal: 39 tensors compared" in r.stdout and "0 changed, 0 only in A, 0 only in B" in r.stdout
    assert (
        "optimizer state: only in" in r.stdout
    )  # an HF folder holds none: said, not counted as a difference
    # and the HF model NxD's tag was made from (the fixture's ground truth), in the library call
    res = ckpt.diff(str(TAG), str(outs["truth"]), config=json.loads((FIX / "config.json").read_text()))
    assert res.same and len(res.tensors) == 39 and all(t.equal for t in res.tensors)


def test_a_planted_one_element_change_is_found_and_named(outs: dict[str, Path], tmp_path: Path) -> None:
    def plant(t: dict[str, torch.Tensor]) -> None:
        t[PLANTED] = t[PLANTED].clone()
        t[PLANTED][5, 7] += 1e-3

    hf = _edited(outs["hf"], tmp_path / "hf", plant)
    r = ckpt_cli("diff", TAG, hf, "--config", hf / "config.json")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"! {PLANTED}: max abs" in r.stdout and "1 element outside tolerance, first at [5, 7]" in r.stdout
    assert "different: 39 tensors compared" in r.stdout and "38 equal, 1 changed" in r.stdout
    doc = json.loads(run("diff", TAG, hf, "--config", hf / "config.json", "--json").stdout)
    assert doc["same"] is False and doc["changed"] == [PLANTED]
    (row,) = [t for t in doc["tensors"] if t["name"] == PLANTED]
    assert (
        row["first_index"] == [5, 7]
        and row["differing"] == 1
        and row["max_abs"] == pytest.approx(1e-3, rel=1e-3)
    )
    # within a tolerance that covers it: equal (exit 0), the tensor counted as within tolerance
    r = run("diff", TAG, hf, "--config", hf / "config.json", "--atol", "2e-3")
    assert r.exit_code == 0 and "1 within tolerance" in r.stdout, r.output
    r = run("diff", TAG, hf, "--config", hf / "config.json", "--rtol", "1e-9")
    assert r.exit_code == 1


def test_optimizer_state_and_step_compare_where_both_hold_them(outs: dict[str, Path], tmp_path: Path) -> None:
    res = ckpt.diff(str(TAG), str(outs["ckpt"]), config=json.loads((FIX / "config.json").read_text()))
    optim = [t for t in res.tensors if t.role == "optimizer_state"]
    assert res.same and res.optimizer == "compared" and res.step_a == res.step_b == 3
    assert len(optim) == 2 * 39  # both moments of every parameter, assembled from the ZeRO-1 shards
    assert {t.name.rsplit("/", 1)[-1] for t in optim} == {"exp_avg", "exp_avg_sq"}
    later = tmp_path / "step5"
    convert(str(outs["ckpt"]), str(later), ConvertOptions(to="cuda", format="ckpt", step=5))
    res = ckpt.diff(str(outs["ckpt"]), str(later))
    assert not res.changed and res.steps_differ and res.exit_code == 1
    r = run("diff", outs["ckpt"], later)
    assert r.exit_code == 1 and "step: 3 -> 5" in r.stdout


def test_dcp_and_our_format_compare_equal(outs: dict[str, Path]) -> None:
    r = run("diff", outs["ckpt"], outs["dcp"], "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["same"] and doc["optimizer"] == "compared", r.output
    assert doc["a"]["format"] == "ckpt" and doc["b"]["format"] == "dcp" and doc["compared"] > 39


def test_missing_extra_shape_and_dtype_changes_are_named(outs: dict[str, Path], tmp_path: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["model.extra.weight"] = torch.zeros(2)
        del t["model.norm.weight"]
        t["lm_head.weight"] = t["lm_head.weight"].to(torch.bfloat16)
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].t().contiguous()

    hf = _edited(outs["hf"], tmp_path / "hf", edit)
    res = ckpt.diff(str(outs["hf"]), str(hf))
    assert res.only_a == ["model.norm.weight"] and res.only_b == ["model.extra.weight"]
    by = {t.name: t for t in res.changed}
    assert set(by) == {"lm_head.weight", "model.layers.0.mlp.up_proj.weight"}
    assert by["lm_head.weight"].dtype_b == "BF16" and by["lm_head.weight"].what.startswith(
        "dtype F32 -> BF16"
    )
    up = by["model.layers.0.mlp.up_proj.weight"]
    assert up.what == f"shape {list(up.shape_a)} -> {list(up.shape_b)}" and up.shape_a != up.shape_b
    r = run("diff", outs["hf"], hf)
    assert r.exit_code == 1
    assert (
        "only in A (1):\n  model.norm.weight" in r.stdout
        and "only in B (1):\n  model.extra.weight" in r.stdout
    )


def test_a_peft_adapter_equals_the_nxd_lora_tag_made_from_it(tmp_path: Path) -> None:
    cfg = LORA / "base" / "config.json"
    tag = tmp_path / "lora" / "step_0"
    r = run("convert", LORA / "adapter", tag, "--to", "neuron", "--format", "nxd", "--tp", "2",
            "--qkv-linear", "--config", cfg)  # fmt: skip
    assert r.exit_code == 0, r.output
    r = run("diff", LORA / "adapter", tag, "--config", cfg)
    assert r.exit_code == 0, r.output
    assert "[peft]" in r.stdout and "[nxd-lora]" in r.stdout and " 0 changed" in r.stdout


def test_usage_errors_exit_2_with_one_line(outs: dict[str, Path], tmp_path: Path) -> None:
    assert_one_error(ckpt_cli("diff", outs["hf"], tmp_path / "nope"), "no such file or directory")
    assert_one_error(ckpt_cli("diff", TAG, outs["hf"]), "pass --config")
    assert_one_error(ckpt_cli("diff", outs["hf"], outs["hf"], "--atol", "-1"), "--atol")
    r = run("diff", outs["hf"])
    assert r.exit_code == 2 and "Missing argument" in r.stderr
