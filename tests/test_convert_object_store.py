"""Every output format goes to an object store (S3 on a real moto server) through the storage layer: the same
bytes as the local export, markers last, nothing left when the destination is taken or the export fails, and no
URL is ever treated as a local path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt.converters.convert import ConvertOptions, RunOptions, convert

from ckpt.errors import CheckpointExistsError
from tests.conftest import S3Target

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"
TAG = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
CONFIG = json.loads((FIX / "config.json").read_text())
FORMATS = {
    "hf": ConvertOptions(to="cuda", format="hf", config=CONFIG, max_shard_bytes=100_000),
    "dcp": ConvertOptions(to="cuda", format="dcp", config=CONFIG),
    "nxd": ConvertOptions.neuron(format="nxd", tp=2, pp=2, dp=2, qkv_linear=True, config=CONFIG),
    "ckpt": ConvertOptions(to="cuda", config=CONFIG),
}
MARKER = {"hf": "model.safetensors.index.json", "dcp": ".metadata", "nxd": "done", "ckpt": "manifest.json"}

pytestmark = pytest.mark.s3


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fmt", ["hf", "nxd", "dcp"])
def test_folder_formats_go_to_s3_with_the_local_bytes(fmt: str, s3: S3Target, tmp_path: Path) -> None:
    local = tmp_path / "local"
    convert(str(TAG), str(local), FORMATS[fmt])
    url = f"{s3.url}/{fmt}"
    convert(str(TAG), url, FORMATS[fmt], RunOptions(storage_options=s3.storage_options))
    fs = s3.fs()
    fs.invalidate_cache()
    got = tmp_path / "got"
    fs.get(url.removeprefix("s3://") + "/", str(got), recursive=True)
    want, have = _files(local), _files(got)
    assert sorted(have) == sorted(want)
    differ = [n for n in want if want[n] != have[n]]
    # DCP's .metadata carries the checkpoint id (the destination) and a random save id; everything else is equal
    assert differ == ([".metadata"] if fmt == "dcp" else []), differ
    assert not list(tmp_path.glob("s3:*")) and not Path("s3:").exists()


@pytest.mark.parametrize("fmt", ["hf", "nxd", "ckpt"])
def test_taken_destination_is_refused_and_untouched(fmt: str, s3: S3Target) -> None:
    url = f"{s3.url}/{fmt}"
    fs = s3.fs()
    fs.pipe(url.removeprefix("s3://") + "/keep.txt", b"mine")
    if fmt == "ckpt":
        fs.pipe(url.removeprefix("s3://") + "/manifest.json", b"{}")
    with pytest.raises(CheckpointExistsError):
        convert(str(TAG), url, FORMATS[fmt], RunOptions(storage_options=s3.storage_options))
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url.removeprefix("s3://"), detail=False))
    assert names == (["keep.txt", "manifest.json"] if fmt == "ckpt" else ["keep.txt"])


@pytest.mark.parametrize("fmt", ["hf", "nxd"])
def test_a_failed_export_leaves_nothing_on_s3(
    fmt: str, s3: S3Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt.converters.engine import execute

    calls = {"n": 0}
    real = execute.assemble

    def failing(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] > 20:
            raise RuntimeError("network gone")
        return real(*a, **kw)

    monkeypatch.setattr(execute, "assemble", failing)
    url = f"{s3.url}/{fmt}"
    with pytest.raises(RuntimeError, match="network gone"):
        convert(str(TAG), url, FORMATS[fmt], RunOptions(storage_options=s3.storage_options))
    fs = s3.fs()
    fs.invalidate_cache()
    assert not fs.exists(url.removeprefix("s3://") + "/" + MARKER[fmt])
    assert fs.find(url.removeprefix("s3://")) == []
    assert s3.boto3_client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []


def test_cli_hf_to_s3_url(s3: S3Target, tmp_path: Path) -> None:
    """The real command with an s3:// DST (endpoint from the environment): the HF folder lands in the bucket, not
    in a local folder called ``s3:``."""
    env = dict(
        os.environ, AWS_ENDPOINT_URL_S3=s3.endpoint or "", AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x"
    )
    url = f"{s3.url}/cli-hf"
    r = subprocess.run(
        [sys.executable, "-m", "ckpt", "convert", str(TAG), url, "--to", "cuda", "--format", "hf", "--config",
         str(FIX / "config.json")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "s3:").exists()
    fs = s3.fs()
    fs.invalidate_cache()
    assert fs.exists(url.removeprefix("s3://") + "/model.safetensors.index.json")
    assert fs.exists(url.removeprefix("s3://") + "/config.json")
