"""A Neuron flag given without a side (``--hw``...) describes whichever side of ``ckpt convert`` is Neuron: an NxD
tag SRC converted to CUDA takes ``--hw`` as its own (as ``--source-hw``); with both sides Neuron, a flag the tag's
files cannot tell is refused in one line naming ``--source-hw`` and ``--target-hw``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from ckpt.cli.main import cli
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt.layouts import bit_equal

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"
CONFIG = str(FIX / "config.json")


def _weights(folder: Path) -> dict:
    return {n: t for f in sorted(folder.glob("*.safetensors")) for n, t in load_file(f).items()}


def _convert(*args: str) -> object:
    return CliRunner().invoke(cli, ["convert", *args, "--config", CONFIG])


@pytest.fixture(scope="module")
def trn2_tag(tmp_path_factory) -> Path:
    """A trn2 NxD tag (KV heads replicated twice, in trn2's order) of the fixture's ground-truth model."""
    root = tmp_path_factory.mktemp("sides")
    hf = root / "hf"
    hf.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(FIX / f, hf / f)
    tag = root / "tag"
    r = _convert(str(hf), str(tag), "--to", "neuron", "--format", "nxd", "--tp", "4", "--qkv-linear",
                 "--kv-size-multiplier", "2", "--hw", "trn2")  # fmt: skip
    assert r.exit_code == 0, r.output
    return tag


def test_hw_of_an_nxd_tag_converted_to_cuda_is_the_sources(trn2_tag: Path, tmp_path: Path) -> None:
    """``--from neuron --to cuda --hw trn2``: the only Neuron side is SRC, so --hw is SRC's, exactly as
    ``--source-hw`` (it used to be refused with "use --source-hw")."""
    truth = load_file(FIX / "model.safetensors")
    r = _convert(str(trn2_tag), str(tmp_path / "a"), "--from", "neuron", "--to", "cuda", "--format", "hf",
                 "--hw", "trn2")  # fmt: skip
    assert r.exit_code == 0, r.output
    got = _weights(tmp_path / "a")
    assert set(got) == set(truth) and all(bit_equal(got[n], truth[n]) for n in truth)
    r = _convert(str(trn2_tag), str(tmp_path / "b"), "--from", "neuron", "--to", "cuda", "--format", "hf",
                 "--source-hw", "trn2")  # fmt: skip
    assert r.exit_code == 0, r.output
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name
    # the flag is used: read as trn1 (the default), the tag's KV heads come out in another order
    r = _convert(str(trn2_tag), str(tmp_path / "c"), "--from", "neuron", "--to", "cuda", "--format", "hf")
    assert r.exit_code != 0 or not all(bit_equal(t, truth[n]) for n, t in _weights(tmp_path / "c").items())


def test_hw_with_both_sides_neuron_names_both_prefixed_flags(trn2_tag: Path, tmp_path: Path) -> None:
    dst = tmp_path / "n"
    r = _convert(str(trn2_tag), str(dst), "--to", "neuron", "--hw", "trn2")
    assert r.exit_code == 2 and not dst.exists()
    (line,) = r.output.strip().splitlines()
    assert "--source-hw" in line and "--target-hw" in line, line
    r = _convert(str(trn2_tag), str(dst), "--to", "neuron", "--source-hw", "trn2", "--target-hw", "trn2")
    assert r.exit_code == 0, r.output


def test_a_flag_given_with_and_without_its_side_is_refused(trn2_tag: Path, tmp_path: Path) -> None:
    r = _convert(str(trn2_tag), str(tmp_path / "c"), "--to", "cuda", "--hw", "trn2", "--source-hw", "trn1")
    assert r.exit_code == 2 and "--hw and --source-hw both given" in r.output, r.output


def test_the_cli_and_the_library_name_the_same_source_flags() -> None:
    from ckpt.cli.convert import SOURCE_FLAGS
    from ckpt.converters.options import SOURCE_FLAGS as LIBRARY

    assert SOURCE_FLAGS == LIBRARY
