"""Lightning's DeepSpeed checkpoint folders (ZeRO stages 1, 2, 3; 1 and 2 gloo ranks; fp32 and fp16) in every
command, read without DeepSpeed.  The folders under fixtures/lightning_deepspeed/ were written by Lightning's
DeepSpeedStrategy driving DeepSpeed 0.19.8's own engine (make_fixture.py); each ``truth.pt`` is DeepSpeed's own
reading of its folder (``zero_to_fp32``'s weights, the moments through the same gather), so every comparison below
is against DeepSpeed, bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

os.environ.setdefault("USE_TORCH_XLA", "0")

from ckpt.cli.main import cli as group  # noqa: E402

from ckpt.layouts import Piece  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lightning_deepspeed"
CASES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
LLAMA = [c for c in CASES if c.startswith("llama")]
#: the tiny LlamaForCausalLM the LightningModule holds as ``self.model`` (make_fixture.py)
LLAMA_CONFIG = {"model_type": "llama", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 12,
                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                "max_position_embeddings": 16, "tie_word_embeddings": False}  # fmt: skip


def cli(*args: object) -> tuple[int, str]:
    r = CliRunner().invoke(group, [str(a) for a in args])
    return r.exit_code, r.output


def folder(case: str) -> Path:
    (found,) = (FIXTURES / case).glob("*.ckpt")
    return found


def truth(case: str) -> dict:
    return torch.load(FIXTURES / case / "truth.pt", weights_only=True)


def read_all(path: Path, config: dict | None = None) -> dict[str, torch.Tensor]:
    from ckpt.converters.lightning import open_source

    src = open_source(str(path), config=config)
    try:
        return {n: src.read(Piece(n, None, None)).clone() for n in src.tensors}
    finally:
        src.close()


def test_fixtures_are_what_the_tests_say() -> None:
    assert set(CASES) == {"llama_zero1_2ranks", "llama_zero2_2ranks", "llama_zero3_2ranks", "mlp_zero2_fp16",
                          "mlp_zero3"}  # fmt: skip
    assert sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file()) < 500_000
    ranks = sorted((folder("llama_zero3_2ranks") / "checkpoint").glob("zero_pp_rank_*_optim_states.pt"))
    assert len(ranks) == 2  # two real partitions


@pytest.mark.parametrize("case", CASES)
def test_every_tensor_equals_deepspeeds_own_reading(case: str) -> None:
    t = truth(case)
    got = read_all(folder(case))
    expected = dict(t["weights"])
    for name, moments in t["moments"].items():
        expected.update({f"optim/{name}/{k}": v for k, v in moments.items()})
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("case", CASES)
def test_inspect_verify_diff_read_the_folder(case: str, tmp_path: Path) -> None:
    path = folder(case)
    stage = case.split("zero")[1][0]
    code, out = cli("inspect", path)
    assert code == 0 and f"Lightning DeepSpeed ZeRO-{stage}" in out and "step 3" in out, out
    assert "/exp_avg_sq" in out
    code, out = cli("verify", path)
    assert code == 0 and out.startswith("ok "), out
    code, out = cli("convert", path, tmp_path / "ours", "--to", "cuda")
    assert code == 0, out
    code, out = cli("diff", path, tmp_path / "ours")
    assert code == 0 and " 0 changed, 0 only in A, 0 only in B" in out, out
    # the converted checkpoint keeps Lightning's other entries and DeepSpeed's record
    manifest = json.loads((tmp_path / "ours" / "manifest.json").read_text())
    assert manifest["step"] == 3 and "lightning" in manifest["extra"] and "deepspeed" in manifest["extra"]


def test_ls_lists_the_folders_beside_our_checkpoints(tmp_path: Path) -> None:
    for case in ("llama_zero3_2ranks", "mlp_zero2_fp16"):
        shutil.copytree(folder(case), tmp_path / "run" / case / folder(case).name)
    code, out = cli("convert", folder("mlp_zero3"), tmp_path / "run" / "step_3", "--to", "cuda")
    assert code == 0, out
    code, out = cli("ls", tmp_path / "run", "--json")
    assert code == 0, out
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["step_3"]["format"] == "ckpt"
    for case in ("llama_zero3_2ranks", "mlp_zero2_fp16"):
        row = rows[f"{case}/epoch=0-step=3.ckpt"]
        assert row["format"] == "lightning" and row["step"] == 3 and row["status"] == "ok", row


@pytest.mark.parametrize("case", LLAMA)
def test_convert_to_hf_with_config_loads_in_transformers_bit_for_bit(case: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_CONFIG))
    code, out = cli("convert", folder(case), tmp_path / "hf", "--to", "cuda", "--format", "hf", "--config", config)
    assert code == 0, out
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    weights = truth(case)["weights"]
    state = model.state_dict()
    assert set(state) == {n.removeprefix("model.") for n in weights}
    for name, tensor in weights.items():
        assert torch.equal(state[name.removeprefix("model.")], tensor), name


@pytest.mark.parametrize("case", ["llama_zero1_2ranks", "llama_zero3_2ranks"])
def test_convert_to_ckpt_keeps_the_moments_by_name_and_round_trips_dcp_and_nxd(case: str, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_CONFIG))
    code, out = cli("convert", folder(case), tmp_path / "ours", "--to", "cuda", "--config", config)
    assert code == 0, out
    from ckpt.converters.ckpt import open_source

    src = open_source(str(tmp_path / "ours"), config=None, storage_options=None)
    try:
        t = truth(case)
        for name, moments in t["moments"].items():
            for key, tensor in moments.items():
                got = src.read(Piece(f"optim/{name.removeprefix('model.')}/{key}", None, None))
                assert torch.equal(got, tensor), (name, key)
    finally:
        src.close()
    code, out = cli("convert", folder(case), tmp_path / "dcp", "--to", "cuda", "--format", "dcp")
    assert code == 0 and (tmp_path / "dcp" / ".metadata").is_file(), out
    code, out = cli("diff", folder(case), tmp_path / "dcp")
    assert code == 0 and " 0 changed, 0 only in A, 0 only in B" in out, out
    code, out = cli("convert", folder(case), tmp_path / "nxd", "--to", "neuron", "--format", "nxd", "--tp", "1",
                    "--config", config)  # fmt: skip
    assert code == 0, out
    code, out = cli("convert", tmp_path / "nxd", tmp_path / "back", "--to", "cuda", "--config", config)
    assert code == 0, out
    code, out = cli("diff", tmp_path / "ours", tmp_path / "back")
    assert " 0 changed, 0 only in A, 0 only in B" in out, out


def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / folder(case).name
    shutil.copytree(folder(case), dst)
    return dst


def _refused(src: Path, tmp_path: Path, *words: str) -> None:
    for command in ("inspect", "verify"):
        code, out = cli(command, src)
        assert code != 0 and all(w in out for w in words), (command, out)
        assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    code, out = cli("convert", src, tmp_path / "out", "--to", "cuda")
    assert code != 0 and all(w in out for w in words) and not (tmp_path / "out").exists(), out


def test_a_truncated_partition_is_refused(tmp_path: Path) -> None:
    src = _copy("llama_zero2_2ranks", tmp_path)
    part = src / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    _refused(src, tmp_path, "zero_pp_rank_1_mp_rank_00_optim_states.pt")


def test_a_missing_rank_file_is_refused(tmp_path: Path) -> None:
    src = _copy("llama_zero3_2ranks", tmp_path)
    (src / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    _refused(src, tmp_path, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "missing")


def _rename_global(file: Path, old: bytes, new: bytes) -> None:
    """Rewrite ``file``'s pickle with one global renamed (same zip entries, stored, as torch.save writes them)."""
    with zipfile.ZipFile(file) as z:
        entries = [(i, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED) as z:
        for info, data in entries:
            z.writestr(info, data.replace(old, new) if info.filename.endswith("data.pkl") else data)


def test_an_unknown_pickled_global_is_refused_by_name(tmp_path: Path) -> None:
    src = _copy("mlp_zero2_fp16", tmp_path)
    optim = src / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _rename_global(optim, b"loss_scaler\nDynamicLossScaler", b"loss_scaler\nDynamicLossScalex")
    _refused(src, tmp_path, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScalex", "not on the allow-list")


def test_model_parallel_and_shapes_that_do_not_add_up_are_refused(tmp_path: Path) -> None:
    src = _copy("mlp_zero3", tmp_path)
    ck = src / "checkpoint"
    shutil.copy(ck / "zero_pp_rank_0_mp_rank_00_model_states.pt", ck / "zero_pp_rank_0_mp_rank_01_model_states.pt")
    _refused(src, tmp_path, "model-parallel")
    (ck / "zero_pp_rank_0_mp_rank_01_model_states.pt").unlink()
    # a parameter shape that no longer matches the partitions: 7x5 recorded as 7x6
    model = ck / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    with zipfile.ZipFile(model) as z:
        pkl = next(z.read(n) for n in z.namelist() if n.endswith("data.pkl"))
    assert b"K\x07K\x05\x86" in pkl  # torch.Size([7, 5]) as pickled: BININT1 7, BININT1 5, TUPLE2
    _rename_global(model, b"K\x07K\x05\x86", b"K\x07K\x06\x86")
    _refused(src, tmp_path, "param_shapes")


@pytest.mark.parametrize("case", ["llama_zero1_2ranks", "llama_zero2_2ranks", "llama_zero3_2ranks"])
def test_partitioning_deepspeeds_weights_gives_its_saved_partitions(case: str) -> None:
    """The layout module's partition side (what tests/test_deepspeed_zero_layout.py reads back) is DeepSpeed's:
    DeepSpeed's own fp32 weights, partitioned by it, are the saved fp32 partitions, bit for bit."""
    from ckpt.converters.deepspeed_pickle import load_deepspeed_file
    from ckpt.converters.deepspeed_zero import partition_zero3, partition_zero12

    ck = folder(case) / "checkpoint"
    weights = truth(case)["weights"]
    stage3 = "zero3" in case
    head = load_deepspeed_file(ck / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage3 else
                                     "mp_rank_00_model_states.pt"))  # fmt: skip
    osds = [load_deepspeed_file(ck / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
            for r in range(2)]  # fmt: skip
    groups = [[weights[n] for n in shapes] for shapes in head["param_shapes"]]
    if stage3:
        flat = partition_zero3([t for g in groups for t in g], 2, 10**9)
        saved = [o["fp32_flat_groups"] for o in osds]
    else:
        flat, _, paddings = partition_zero12(groups, 2, 1)
        assert paddings == osds[0].get("param_alignment_paddings", paddings)
        saved = [o["single_partition_of_fp32_groups"] for o in osds]
    assert [[t.numel() for t in r] for r in flat] == [[t.numel() for t in r] for r in saved]
    for mine, theirs in zip(flat, saved, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
