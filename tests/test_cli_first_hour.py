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
    in ``inspect``, ``ls`` and the converted manifest; the name's digits are no source, so nothing disagrees."""
    import json
    import shutil

    tag = tmp_path / "runs" / "run7"
    shutil.copytree(TAG, tag)
    r = ckpt_cli("inspect", tag, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step"] == 3
    assert r.stderr == "", r.stderr
    listed = ckpt_cli("ls", tag.parent, "--json")
    assert [row["step"] for row in json.loads(listed.stdout)] == [3], listed.stderr
    dst = tmp_path / "cuda"
    conv = ckpt_cli("convert", tag, dst, "--to", "cuda", "--config", CONFIG)
    assert conv.returncode == 0, conv.stderr
    assert ckpt.open_checkpoint(str(dst)).manifest.step == 3
    assert conv.stderr == "", conv.stderr


def test_agreeing_sources_give_no_warning_and_a_bare_tag_has_an_unknown_step(tmp_path: Path) -> None:
    import shutil
    import warnings

    from ckpt.converters.nxd.files import scan_tag
    from ckpt.converters.nxd.step import step_sources, tag_step

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        files = scan_tag(TAG)
        assert tag_step(files) == 3
        assert [v for _, v in step_sources(files)] == [3, 3]
    bare = tmp_path / "step_12"
    shutil.copytree(TAG, bare)
    (bare / "user_content.pt").unlink()
    (bare / "scheduler.pt").unlink()
    assert tag_step(scan_tag(bare)) is None  # "step_12" is a name, not a record


# ------------------------------------------------------------------------------------------------ 4: bad input


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real HF model folder (the fixture's config.json + model.safetensors)."""
    import shutil

    d = tmp_path_factory.mktemp("hf") / "model"
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIX / name, d / name)
    return d


def _broken_hf(hf_folder: Path, tmp_path: Path, how: str) -> Path:
    import shutil

    d = tmp_path / f"hf_{how}"
    shutil.copytree(hf_folder, d)
    if how == "truncated":
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[:-100])
    else:
        (d / "config.json").write_text("{not json")
    return d


@pytest.mark.parametrize(
    "how, dry_run, needles",
    [
        ("truncated", False, ("model.safetensors", "truncated", "fetch the file again")),
        ("truncated", True, ("model.safetensors", "truncated")),
        ("bad_config", False, ("config.json", "not valid JSON")),
    ],
)
def test_a_damaged_hf_folder_is_one_line(
    hf_folder: Path, tmp_path: Path, how: str, dry_run: bool, needles: tuple[str, ...]
) -> None:
    src = _broken_hf(hf_folder, tmp_path, how)
    before = tree(src)
    dst = tmp_path / "out"
    r = ckpt_cli("convert", src, dst, "--to", "cuda", *(["--dry-run"] if dry_run else []))
    assert_one_error(r, *needles, code=1)  # a damaged SRC: exit 1, as for every found damage
    assert tree(dst) == {} and tree(src) == before


def test_bad_config_and_dst_are_one_line(hf_folder: Path, tmp_path: Path) -> None:
    import json

    no_heads = json.loads((FIX / "config.json").read_text())
    del no_heads["num_attention_heads"]
    (tmp_path / "no_heads.json").write_text(json.dumps(no_heads))
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "a_file").write_text("mine")
    cases = [
        (["--to", "cuda", "--config", tmp_path / "empty_dir"], tmp_path / "o1", ("empty_dir", "directory")),
        (["--to", "neuron", "--tp", "2", "--config", tmp_path / "no_heads.json"], tmp_path / "o2",
         ("num_attention_heads", "--config")),
        (["--to", "cuda"], tmp_path / "a_file", ("a_file", "existing file")),
        (["--to", "cuda"], tmp_path / "a_file" / "sub", ("a_file", "not a folder")),
    ]  # fmt: skip
    for args, dst, needles in cases:
        r = ckpt_cli("convert", hf_folder, dst, *args)
        assert_one_error(r, *needles)
    assert sorted(tree(tmp_path)) == ["a_file", "no_heads.json"]
    assert (tmp_path / "a_file").read_text() == "mine"


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root may write anywhere")  # fmt: skip
def test_unwritable_dst_is_one_line(hf_folder: Path, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    assert_one_error(ckpt_cli("convert", hf_folder, ro / "out", "--to", "cuda"), "not writable")
    assert tree(ro) == {}


def test_ls_of_a_scheme_without_its_package_and_demo_kill_at(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("gcsfs") is None:
        assert_one_error(ckpt_cli("ls", "gs://bucket/run"), "gcsfs", "pip install")
    r = ckpt_cli("demo", "--kill-at", "3", "--dir", tmp_path / "demo")
    assert_one_error(r, "--kill-at 3")
    assert tree(tmp_path) == {}


def test_save_refuses_a_module_as_optimizer_and_a_negative_step(tmp_path: Path) -> None:
    import torch

    model = torch.nn.Linear(4, 3)
    mgr = ckpt.CheckpointManager(str(tmp_path / "run"), async_save=False)
    with pytest.raises(ckpt.StateMismatchError, match="not an optimizer"):
        mgr.save(1, model=model, optimizer=model)
    for bad in (-1, 1.5, True):
        with pytest.raises(ckpt.CkptError, match="non-negative integer"):
            mgr.save(bad, model=model)  # type: ignore[arg-type]
    assert tree(tmp_path) == {}


# ------------------------------------------------------------------------------------------------ 6: round trips


def test_a_round_trip_keeps_the_recorded_neuron_layout(tmp_path: Path) -> None:
    """NxD (qkv_proj.weight_q/k/v) -> CUDA -> NxD writes qkv_proj.weight_q/k/v again, saying so in one warning;
    an explicit --no-qkv-linear still chooses q_proj/k_proj/v_proj."""
    import torch

    cuda, back, plain = tmp_path / "cuda", tmp_path / "back", tmp_path / "plain"
    assert ckpt_cli("convert", TAG, cuda, "--to", "cuda", "--config", CONFIG).returncode == 0
    r = ckpt_cli("convert", cuda, back, "--to", "neuron", "--format", "nxd", "--tp", "2")
    assert r.returncode == 0, r.stderr
    (warning,) = r.stderr.splitlines()
    assert warning.startswith("ckpt: warning: ") and "qkv_linear=True" in warning
    names = list(torch.load(back / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True))
    assert "model.layers.0.self_attn.qkv_proj.weight_q" in names
    r = ckpt_cli("convert", cuda, plain, "--to", "neuron", "--format", "nxd", "--tp", "2", "--no-qkv-linear")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    names = list(torch.load(plain / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True))
    assert "model.layers.0.self_attn.q_proj.weight" in names


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--to", "cuda", "--xser"], "--xser/--no-xser is for --format nxd"),
        (["--to", "cuda", "--format", "hf", "--codec", "zstd"], "--codec is for --format ckpt"),
        (["--to", "cuda", "--max-shard-size", "1MB"], "--max-shard-size is for --format hf"),
        (["--to", "cuda", "--tp", "4"], "does nothing with --to cuda"),
    ],
)
def test_flags_that_would_do_nothing_are_refused(
    hf_folder: Path, tmp_path: Path, args: list, needle: str
) -> None:
    assert_one_error(ckpt_cli("convert", hf_folder, tmp_path / "out", *args, "--config", CONFIG), needle)
    assert tree(tmp_path) == {}


# ------------------------------------------------------------------------------------------------ 7: summaries


def test_nxd_to_hf_says_what_it_wrote_and_what_it_left_out(tmp_path: Path) -> None:
    import json

    dst = tmp_path / "hf"
    r = ckpt_cli("convert", TAG, dst, "--to", "cuda", "--format", "hf", "--config", CONFIG)
    assert r.returncode == 0, r.stderr
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    held = len(index["weight_map"])
    assert f"converted {held} tensors" in r.stdout
    (warning,) = r.stderr.splitlines()
    assert warning.startswith("ckpt: warning: not written to")
    assert "78 optimizer-state tensors" in warning and "scheduler state" in warning
    assert "Hugging Face folder holds model weights" in warning
    plan = ckpt_cli("convert", TAG, tmp_path / "x", "--to", "cuda", "--format", "hf", "--config", CONFIG,
                    "--dry-run")  # fmt: skip
    assert f"tensors: {held} (parameter {held})" in plan.stdout
    assert "not written: 78 optimizer-state tensors" in plan.stdout
    assert not (tmp_path / "x").exists()


def test_a_source_without_a_step_says_so(hf_folder: Path, tmp_path: Path) -> None:
    r = ckpt_cli("convert", hf_folder, tmp_path / "nxd", "--to", "neuron", "--format", "nxd", "--tp", "2")
    assert r.returncode == 0, r.stderr
    (warning,) = r.stderr.splitlines()
    assert "records no training step" in warning and "--step" in warning
    r = ckpt_cli("convert", hf_folder, tmp_path / "ck", "--to", "cuda", "--step", "7")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert ckpt.open_checkpoint(str(tmp_path / "ck")).manifest.step == 7


# ------------------------------------------------------------------------------------------------ 8: output

BOX = set("┃│━─┏┓┗┛┡┩└┘╇┼")


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory: ``checkpoints/step_00000010`` and ``step_00000020`` (model + Adam state)."""
    import torch

    run = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 8)).sum().backward()
    opt.step()
    mgr = ckpt.CheckpointManager(str(run / "checkpoints"), async_save=False)
    for step in (10, 20):
        mgr.save(step, model=m, optimizer=opt)
    return run


@pytest.fixture(scope="module")
def sim_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.test_resume_sim import simulate

    return (
        simulate(tmp_path_factory.mktemp("sim") / "a", "correct"),
        simulate(tmp_path_factory.mktemp("sim") / "b", "correct"),
    )


def _plain_output(text: str) -> None:
    assert text.strip(), "no output"
    assert not BOX & set(text), text[:2000]
    trailing = [ln for ln in text.splitlines() if ln != ln.rstrip()]
    assert not trailing, trailing[:3]


def test_piped_output_is_plain_text_with_whole_names(ckpt_root: Path, sim_runs: tuple[Path, Path]) -> None:
    cks = ckpt_root / "checkpoints"
    a, b = sim_runs
    for args, whole in [
        (("ls", cks), "committed"),
        (("inspect", cks / "step_00000020"), "optim/1.bias/exp_avg_sq"),
        (("verify-resume", a), "CONTINUOUS at 1 boundary\n"),
        (("report", a), ": 2 sessions"),
        (("compare", a, b), "what"),
    ]:
        r = ckpt_cli(*args)
        assert r.returncode == 0, (args, r.stderr[-2000:])
        _plain_output(r.stdout)
        assert whole in r.stdout, (args, r.stdout[:2000])
    assert "boundaries" not in ckpt_cli("verify-resume", a).stdout


def test_terminal_tables_fit_and_wrap_names_at_dots() -> None:
    import io

    from ckpt.cli.table import Col, plain_lines, print_table
    from rich.console import Console

    names = [f"model.layers.{i}.self_attn.qkv_proj.weight_q" for i in range(3)]
    rows = [[n, "optimizer_state (exp_avg_sq)", "[4096, 4096]", "BF16", "32.0 MiB"] for n in names]
    cols = [
        Col("tensor", name=True),
        Col("role", fold=True),
        Col("shape"),
        Col("dtype"),
        Col("size", "right"),
    ]
    buf = io.StringIO()
    print_table(Console(file=buf, force_terminal=True, width=80, color_system=None), cols, rows)
    lines = buf.getvalue().splitlines()
    assert max(len(ln) for ln in lines) <= 80, lines
    first_col = ["".join(ln.split("│")[1].split()) for ln in lines if ln.startswith("│")]
    assert "".join(first_col) == "".join(names)  # every name whole, in order, only split ...
    for piece in first_col:
        assert piece.endswith(".") or any(n.endswith(piece) for n in names), piece  # ... after a dot
    piped = plain_lines(cols, rows)
    assert piped[0].split() == ["tensor", "role", "shape", "dtype", "size"] and names[0] in piped[1]


def test_json_everywhere_and_ls_damage(ckpt_root: Path, tmp_path: Path) -> None:
    import json
    import shutil

    cks = ckpt_root / "checkpoints"
    listed = json.loads(ckpt_cli("ls", cks, "--json").stdout)
    assert listed[0]["layout"]["world_size"] == 1 and listed[0]["status"] == "committed"
    v = ckpt_cli("verify", cks / "step_00000010", "--json")
    assert v.returncode == 0 and json.loads(v.stdout)["ok"] is True
    c = ckpt_cli("convert", cks / "step_00000010", tmp_path / "out", "--to", "cuda", "--json")
    assert c.returncode == 0 and json.loads(c.stdout)["tensors"] == 12, c.stdout  # 4 params + 8 Adam moments
    # a deleted data file: "damaged" without --check-files, exit 1
    copy = tmp_path / "root"
    shutil.copytree(cks, copy)
    step = copy / "step_00000020"
    next(step.glob("*.safetensors")).unlink()
    r = ckpt_cli("ls", copy)
    assert r.returncode == 1 and "damaged" in r.stdout and "missing" in r.stdout, r.stdout
    rows = json.loads(ckpt_cli("ls", copy, "--json").stdout)
    assert [x["status"] for x in rows] == ["committed", "damaged"]


# ------------------------------------------------------------------------------------------------ 9: levels


def test_pointing_at_the_wrong_level_says_what_to_run(
    ckpt_root: Path, hf_folder: Path, tmp_path: Path
) -> None:
    cks = ckpt_root / "checkpoints"
    assert_one_error(ckpt_cli("ls", cks / "step_00000010"), "is a checkpoint", "ckpt inspect")
    listed = ckpt_cli("ls", ckpt_root)  # one level up: listed, under their paths (issue 29: ls finds them)
    assert listed.returncode == 0 and "checkpoints/step_00000020" in listed.stdout, (
        listed.stdout + listed.stderr
    )
    assert_one_error(ckpt_cli("inspect", cks), "holds 2 checkpoints", f"ckpt inspect {cks}/step_00000020")
    assert_one_error(ckpt_cli("verify", ckpt_root), "run directory", "ckpt ls")
    r = ckpt_cli("inspect", cks / "step_00000010" / "manifest.json")
    assert r.returncode == 0 and "step 10" in r.stdout, r.stderr
    for cmd in ("inspect", "verify"):
        r = ckpt_cli(cmd, hf_folder)
        assert r.returncode == 0 and "Hugging Face" in r.stdout, r.stderr
    assert_one_error(ckpt_cli("convert", TAG.parent, tmp_path / "o", "--to", "cuda"), "NxD tag", str(TAG))
    assert_one_error(ckpt_cli("convert", cks, tmp_path / "o", "--to", "cuda"), "step_00000020")
    assert_one_error(ckpt_cli("convert", hf_folder, hf_folder / "out", "--to", "cuda"), "inside SRC")
    assert tree(tmp_path) == {} and "out" not in tree(hf_folder)


# ------------------------------------------------------------------------------------------------ 10: small


def test_s3_without_credentials_says_what_to_set(tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), PJRT_DEVICE="CPU")  # fmt: skip
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ckpt", "ls", "s3://some-bucket/run"], capture_output=True,
                       text=True, env=env, timeout=120)  # fmt: skip
    assert_one_error(r, "NoCredentialsError", "AWS_ACCESS_KEY_ID", "storage_options")


def test_convert_help_has_examples_and_the_docs_speak_to_users() -> None:
    r = ckpt_cli("convert", "--help")
    assert r.returncode == 0 and "Examples:" in r.stdout and "ckpt convert run/step_1000" in r.stdout
    from tests.cli_helpers import ROOT

    assert "The lead" not in (ROOT / "docs" / "convert.md").read_text()
