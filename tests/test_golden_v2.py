"""The golden checkpoints of format v2 (fixtures/golden/v2/) read back exactly, and hold the same facts as the v1
goldens made by the same script (fixtures/golden/make_v1.py --out fixtures/golden/v2, see the README).

Nothing here regenerates them.  A failure means a change broke format v2 (see fixtures/golden/README.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash
from manifest_schema import assert_valid

import ckpt
from ckpt.format.integrity import verify_checkpoint
from ckpt.format.manifest import MANIFEST_NAME, Manifest
from ckpt.format.reader import CheckpointReader

ROOT = Path(__file__).resolve().parent.parent / "fixtures" / "golden"
STEP_DIR = "step_00000003"
CASES = ("single", "sharded", "nxd")


def path_of(version: str, case: str) -> Path:
    return ROOT / version / case / STEP_DIR


@pytest.fixture(scope="module", autouse=True)
def goldens_stay_untouched() -> Iterator[None]:
    def fingerprint() -> dict[str, str]:
        return {
            str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in (ROOT / "v2").rglob("*")
            if p.is_file()
        }

    before = fingerprint()
    assert len(before) == 18, sorted(before)  # 3 manifests, 5 indexes, 5 state files, 5 data files
    yield
    assert fingerprint() == before


@pytest.mark.parametrize("case", CASES)
def test_top_manifest_and_indexes_are_sealed_and_valid(case: str) -> None:
    raw = (path_of("v2", case) / MANIFEST_NAME).read_bytes()
    assert raw[13:37].decode() == "xxh3_64:" + xxhash.xxh3_64_hexdigest(b"{" + raw[39:])
    m = Manifest.from_json(raw, case)
    assert m.format_version == 2 and m.v2 is not None
    doc = assert_valid(path_of("v2", case))
    assert all("shards" not in t for t in doc["tensors"].values())
    assert doc["rng"] == {} and doc["data"] == {}
    ranks = sorted(e["rank"] for e in doc["indexes"].values())
    assert sorted(e["rank"] for e in doc["rank_state"].values()) == ranks  # every rank saved its RNG state
    for name, e in [*doc["indexes"].items(), *doc["rank_state"].items()]:
        iraw = (path_of("v2", case) / name).read_bytes()
        assert (
            iraw[13:37].decode() == e["checksum"] == "xxh3_64:" + xxhash.xxh3_64_hexdigest(b"{" + iraw[39:])
        )
        assert len(iraw) == e["size"]


@pytest.mark.parametrize("case", CASES)
def test_v2_golden_holds_the_facts_of_the_v1_golden(case: str) -> None:
    a = CheckpointReader(str(path_of("v1", case))).manifest
    b = CheckpointReader(str(path_of("v2", case))).manifest
    assert (a.format_version, b.format_version) == (1, 2)
    assert (a.step, a.backend, a.layout) == (b.step, b.backend, b.layout)
    for key in ("optimizer", "scheduler", "scaler", "progress", "data", "rng", "tokenizer", "user", "extra"):
        assert getattr(a, key) == getattr(b, key), key
    assert list(a.tensors) == list(b.tensors)
    for name, ta in a.tensors.items():
        tb = b.tensors[name]
        assert ta.desc == tb.desc
        key = [(s.box, s.nbytes, s.codec, s.checksum, s.file[:7]) for s in ta.shards]
        assert key == [(s.box, s.nbytes, s.codec, s.checksum, s.file[:7]) for s in tb.shards], name


@pytest.mark.parametrize("case", CASES)
def test_every_tensor_reads_as_in_v1(case: str) -> None:
    a = ckpt.open_checkpoint(str(path_of("v1", case)))
    b = ckpt.open_checkpoint(str(path_of("v2", case)))
    for name in a.names():
        assert torch.equal(a.read(name), b.read(name)), name


@pytest.mark.parametrize("case", CASES)
def test_verify_passes(case: str) -> None:
    assert verify_checkpoint(ckpt.open_checkpoint(str(path_of("v2", case)))) == []


def test_sharded_restores_lazily_into_one_process() -> None:
    v1 = ckpt.open_checkpoint(str(path_of("v1", "sharded")))
    model = {n: torch.full(v1.entry(n).shape, float("nan")) for n in v1.names("parameter")}
    ckpt.restore(str(path_of("v2", "sharded")), model=model, rng=False)
    assert all(torch.equal(model[n], v1.read(n)) for n in model)


def test_pieces_of_the_sharded_golden_are_regular() -> None:
    doc = json.loads((path_of("v2", "sharded") / MANIFEST_NAME).read_text())
    pieces = doc["tensors"]["model.layers.0.mlp.gate_proj.weight"]["pieces"]
    assert pieces == {"split": [[0, 2]], "ranks": {"start": 0, "steps": [1]}}
