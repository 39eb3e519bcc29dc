"""``--workers N`` and torchrun ranks for the folder formats (``--format hf|dcp|nxd``).

* The output of 2 local workers (``ckpt convert --workers 2``) and of 3 torchrun-style gloo ranks is the serial
  output: HF and NxD byte for byte (same files, same index), DCP loads to the same state dict through
  ``torch.distributed.checkpoint`` (the data is split over one ``__<w>_0.distcp`` per writer, as DCP does itself).
* A real failure in one worker (its share reads a truncated source shard) leaves nothing at DST, no temp folder,
  and SRC untouched, both with local workers and with torchrun ranks (where every rank learns the failure).

Tiny model (the 4-layer fixture, 0.6 MiB); HF shards of 100 kB so that the HF folder has several files to share.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt.cli.main import cli
from ckpt.converters.convert import ConvertOptions, RunOptions, convert, load_config, make_export
from ckpt.converters.engine import balance
from click.testing import CliRunner

from tests.conftest import run_ranks

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "nxd" / "llama_gqa_h64"
TAG = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
CONFIG = load_config(str(FIX / "config.json"))
SHARD = 100_000  # bytes per HF shard: 7 shards for this model

FORMATS: dict[str, dict[str, Any]] = {
    "hf": dict(to="cuda", format="hf", max_shard_bytes=SHARD),
    "dcp": dict(to="cuda", format="dcp"),
    "nxd": dict(to="neuron", format="nxd", layout=dict(tp=2, pp=2, dp=2, qkv_linear=True)),
}


def opts(fmt: str) -> ConvertOptions:
    return ConvertOptions(config=CONFIG, **FORMATS[fmt])


def files(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root``."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def dcp_state(root: Path) -> dict[str, Any]:
    """The whole DCP checkpoint as loaded by ``torch.distributed.checkpoint`` itself (no skeleton needed)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(str(root), str(Path(d) / "all.pt"))
        return torch.load(Path(d) / "all.pt", weights_only=False)


def assert_equal_tree(a: Any, b: Any, where: str = "") -> None:
    """Same structure, same values; tensors equal in dtype, shape and bits."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_equal_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_same(fmt: str, got: Path, want: Path) -> None:
    if fmt == "dcp":
        a, b = dcp_state(got), dcp_state(want)
        assert a.keys() == b.keys() and len(a["model"]) == 39 and a["optim"]["state"]
        assert_equal_tree(a, b)
    else:
        assert files(got) == files(want)


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Our CUDA manifest of the training fixture (model + Adam moments + scheduler)."""
    out = tmp_path_factory.mktemp("par") / "cuda"
    convert(str(TAG), str(out), ConvertOptions(to="cuda", from_="neuron", config=CONFIG))
    return out


@pytest.fixture(scope="module")
def serial(src: Path) -> dict[str, Path]:
    """The one-process output of every folder format (the reference)."""
    out = {}
    for fmt in FORMATS:
        out[fmt] = src.parent / f"serial_{fmt}"
        convert(str(src), str(out[fmt]), opts(fmt))
    return out


def test_balance_is_deterministic_and_disjoint() -> None:
    w = [5, 1, 9, 9, 0, 3, 7]
    shares = balance(w, 3)
    assert shares == balance(w, 3)
    assert sorted(u for s in shares for u in s) == list(range(len(w)))
    assert max(sum(w[u] for u in s) for s in shares) <= 12
    assert balance([1], 4) == [[0], [], [], []]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_workers_equal_serial(fmt: str, src: Path, serial: dict[str, Path], tmp_path: Path) -> None:
    dst = tmp_path / "par"
    convert(str(src), str(dst), opts(fmt), RunOptions(workers=2))
    assert_same(fmt, dst, serial[fmt])
    if fmt == "hf":
        assert len(list(dst.glob("model-*-of-00007.safetensors"))) == 7
    if fmt == "dcp":
        assert sorted(p.name for p in dst.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        assert [p.name for p in serial[fmt].glob("*.distcp")] == ["__0_0.distcp"]
    if fmt == "nxd":
        assert len(list(dst.glob("model/*.pt"))) == 4 and len(list(dst.glob("optim/*.pt"))) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["par"]  # no temp folder left


def test_cli_workers_nxd_and_hf(src: Path, serial: dict[str, Path], tmp_path: Path) -> None:
    args = ["--to", "neuron", "--format", "nxd", "--tp", "2", "--pp", "2", "--dp", "2", "--qkv-linear"]
    r = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "nxd"), *args, "--workers", "3"])
    assert r.exit_code == 0, r.output
    assert files(tmp_path / "nxd") == files(serial["nxd"])
    args = ["--to", "cuda", "--format", "hf", "--max-shard-size", str(SHARD), "--workers", "2"]
    r = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "hf"), *args])
    assert r.exit_code == 0, r.output
    assert files(tmp_path / "hf") == files(serial["hf"])
    r = CliRunner().invoke(
        cli, ["convert", str(src), str(tmp_path / "x"), "--to", "cuda", "--max-shard-size", "1XB"]
    )
    assert r.exit_code == 2 and "--max-shard-size" in r.output and not (tmp_path / "x").exists()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_commit_refuses_a_missing_unit(fmt: str, src: Path, tmp_path: Path) -> None:
    """A worker that planned differently (a hole in the units) is caught at commit: nothing is published."""
    from ckpt.converters.convert import open_source, plan_conversion

    from ckpt.errors import CkptError

    o = opts(fmt)
    source = open_source(str(src), o)
    export = make_export(plan_conversion(source, o), o, RunOptions())
    dst = str(tmp_path / "dst")
    staging = export.begin(dst)
    shares = balance(export.weights, 2)
    receipt = export.write(staging, shares[0], worker=0)
    with pytest.raises(CkptError, match="missing"):
        export.commit(staging, dst, [receipt])
    export.abort(staging)
    assert list(tmp_path.iterdir()) == []


def _rank_convert_all(rank: int, world: int, src: str, root: str) -> None:
    for fmt in FORMATS:
        convert(src, str(Path(root) / fmt), opts(fmt))


def test_torchrun_ranks_equal_serial(src: Path, serial: dict[str, Path], tmp_path: Path) -> None:
    run_ranks(_rank_convert_all, 3, str(src), str(tmp_path))
    for fmt in FORMATS:
        assert_same(fmt, tmp_path / fmt, serial[fmt])
    assert sorted(p.name for p in (tmp_path / "dcp").glob("*.distcp")) == [
        f"__{r}_0.distcp" for r in range(3)
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FORMATS)


# ------------------------------------------------------------------------------------------------ failures


@pytest.fixture(scope="module")
def broken_src(src: Path) -> Path:
    """An HF source whose last shard has a header entry whose shape does not match its bytes: only the workers
    whose share reads it fail (at read time, in safetensors; opening and planning check the header against the
    file's size, which still agree, so the parent plans without noticing).  A truncated shard, by contrast, is
    refused when SRC is opened (tests/test_cli_first_hour.py)."""
    hf = src.parent / "broken_hf"
    convert(str(src), str(hf), opts("hf"))
    break_last_shard(hf)
    return hf


def break_last_shard(hf: Path) -> None:
    """Halve the rows of a tensor in the header of ``hf``'s last shard (see :func:`broken_src`)."""
    import json
    import struct

    last = sorted(hf.glob("model-*.safetensors"))[-1]
    data = last.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["shape"][0] % 2 == 0)
    header[name]["shape"][0] //= 2  # half the rows: the data offsets now span twice the bytes the shape needs
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    last.write_bytes(data[:8] + text.ljust(n, b" ") + data[8 + n :])


def _snapshot(p: Path) -> dict[str, str]:
    return files(p)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_worker_failure_leaves_nothing(fmt: str, broken_src: Path, tmp_path: Path) -> None:
    before = _snapshot(broken_src)
    dst = tmp_path / "dst"
    with pytest.raises(Exception) as e:  # noqa: B017 - the worker's own error travels back
        convert(str(broken_src), str(dst), opts(fmt), RunOptions(workers=2))
    assert "safetensors" in str(e.value).lower() or "incomplete" in str(e.value).lower(), e.value
    assert list(tmp_path.iterdir()) == []  # no DST, no hidden temp folder
    assert _snapshot(broken_src) == before


def _rank_fail_all(rank: int, world: int, src: str, root: str) -> list[str]:
    from ckpt.errors import CkptError

    messages = []
    for fmt in FORMATS:
        try:
            convert(src, str(Path(root) / fmt), opts(fmt))
        except CkptError as e:
            messages.append(str(e))
        else:
            messages.append("")
    return messages


def test_torchrun_rank_failure_leaves_nothing(broken_src: Path, tmp_path: Path) -> None:
    before = _snapshot(broken_src)
    got = run_ranks(_rank_fail_all, 3, str(broken_src), str(tmp_path))
    for messages in got:  # every rank learns it, for every format
        assert all(m.startswith("conversion failed, nothing committed: rank") for m in messages), messages
        # some ranks wrote their whole share (HF: the one owning the last shard failed, the two others finished):
        # their files went with the temp folder too
        assert messages[0].count("rank ") == 1 and all(m.count("rank ") < 3 for m in messages), messages
    assert got[0] == got[1] == got[2]
    assert list(tmp_path.iterdir()) == []
    assert _snapshot(broken_src) == before
