"""Format v1 and v2 hold the same facts: the same state, saved by 2 gloo ranks once in each version, restores
resharded, inspects, verifies, lists and converts to Hugging Face identically.

Only what differs by definition is set aside before comparing: the format version itself, the save time
(``created_at``), the save attempt's id in file names (``r00000-<attempt>.safetensors``) and the folder's path.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckpt.cli.main import cli
from click.testing import CliRunner
from conftest import run_ranks
from manifest_io import manifest_dict, stored_version

import ckpt
from ckpt import SaveOptions

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"
VERSIONS = (1, 2)
STEP = 3
WORLD = 2

pytestmark = pytest.mark.timeout(300)


def _full() -> dict[str, torch.Tensor]:
    """A real small Llama's weights (fixtures/nxd/llama_gqa_h64): names and shapes the HF exporter knows."""
    from safetensors.torch import load_file

    return load_file(str(FIX / "model.safetensors"))


def _seed(rank: int) -> None:
    """The same RNG state before each version's save, so both record the same RNG trees."""
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)


def _job(rank: int, world: int, root: str) -> dict[int, dict[str, Any]]:
    """Save FSDP-style Shard(0) state in v1 and in v2, then restore each into Shard(1) (a resharded restore);
    return this rank's restored local tensors per version."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    for v in VERSIONS:
        _seed(rank)
        saver = ckpt.Checkpointer(async_save=False, format_version=v)
        saver.save(
            f"{root}/v{v}/step_{STEP:08d}",
            step=STEP,
            model=state,
            options=SaveOptions(progress={"tokens": 96}),
        ).result()
    out = {}
    for v in VERSIONS:
        live = {
            k: distribute_tensor(torch.zeros_like(t), mesh, [Shard(t.dim() - 1)]) for k, t in full.items()
        }
        ckpt.restore(f"{root}/v{v}/step_{STEP:08d}", model=live, rng=False)
        out[v] = {k: t.to_local().numpy().copy() for k, t in live.items()}  # by value through the queue
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[int, dict[str, torch.Tensor]]]]:
    root = tmp_path_factory.mktemp("versions")
    ranks = run_ranks(_job, WORLD, str(root), timeout=240)
    return root, [{v: {k: torch.from_numpy(a) for k, a in r[v].items()} for v in r} for r in ranks]


def ck(root: Path, v: int) -> Path:
    return root / f"v{v}" / f"step_{STEP:08d}"


ATTEMPT = re.compile(r"\b(r\d{5})-[0-9a-f]+\.")


def normal(text: str, root: Path, v: int) -> str:
    """``text`` without what differs between the two saves by definition (see the module docstring)."""
    text = text.replace(str(root / f"v{v}"), "<root>")
    text = ATTEMPT.sub(r"\1-<attempt>.", text)
    return re.sub(r"\d{4}-\d\d-\d\dT[\d:.]+(?:Z|[+-]\d\d:\d\d)?", "<time>", text)


def run_cli(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(cli, list(args))
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    return r.exit_code, r.output


def digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def result(op: str, root: Path, v: int, restored: list[dict[int, dict[str, torch.Tensor]]]) -> Any:
    """What operation ``op`` gives on the version-``v`` checkpoint, in a form comparable across versions."""
    path = str(ck(root, v))
    if op == "manifest":
        doc = manifest_dict(path)
        for k in ("checksum", "created_at"):
            doc.pop(k)
        return json.loads(normal(json.dumps(doc, sort_keys=True), root, v))
    if op == "data files":  # what each rank wrote, byte for byte
        m = ckpt.open_checkpoint(path).manifest
        return {(f.rank, normal(p, root, v)): hashlib.sha256((ck(root, v) / p).read_bytes()).hexdigest()
                for p, f in m.files.items()}  # fmt: skip
    if op == "restore resharded":
        return [r[v] for r in restored]
    if op == "read whole":  # 2 ranks -> 1 process
        reader = ckpt.open_checkpoint(path)
        return {n: reader.read(n) for n in reader.names()}
    if op in ("inspect", "inspect --json --shards", "verify", "verify --json", "ls --json"):
        cmd, *flags = op.split()
        target = str(root / f"v{v}") if cmd == "ls" else path
        code, text = run_cli(cmd, target, *flags)
        if "--json" in flags:
            doc = json.loads(text)
            for d in doc if isinstance(doc, list) else [doc]:
                for k in ("format_version", "checksum", "created_at"):  # the checksum seals created_at
                    d.pop(k, None)
            text = json.dumps(doc, sort_keys=True)
        else:
            text = re.sub(r"\(format v\d, ", "(format v?, ", text)
            # the table of a v2 checkpoint is drawn from its top manifest alone (no index read): its shards
            # column counts pieces ("2 pieces"), which here are one chunk each; the columns' widths follow
            text = re.sub(r" +", " ", re.sub(r"(\d+) pieces\b", r"\1", text))
        return code, normal(text, root, v)
    if op == "convert to hf":
        out = root / f"hf{v}"
        code, text = run_cli("convert", path, str(out), "--to", "cuda", "--format", "hf",
                             "--config", str(FIX / "config.json"))  # fmt: skip
        return code, normal(text.replace(str(out), "<out>"), root, v), digests(out)
    raise AssertionError(op)


OPS = [
    "manifest",
    "data files",
    "restore resharded",
    "read whole",
    "inspect",
    "inspect --json --shards",
    "verify",
    "verify --json",
    "ls --json",
    "convert to hf",
]


def test_each_version_is_on_disk(saved: tuple[Path, Any]) -> None:
    root, _ = saved
    assert [stored_version(ck(root, v)) for v in VERSIONS] == [1, 2]
    assert not list(ck(root, 1).glob("*.index.json"))
    assert len(list(ck(root, 2).glob("*.index.json"))) == WORLD


def _same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("op", OPS)
def test_v1_and_v2_give_the_same_result(saved: tuple[Path, Any], op: str) -> None:
    root, restored = saved
    got = {v: result(op, root, v, restored) for v in VERSIONS}
    _same(got[1], got[2], op)
    # and the result is the right one, not the same mistake twice
    full = _full()
    if op == "restore resharded":
        for rank, r in enumerate(restored):
            for n, t in full.items():
                want = torch.chunk(t, WORLD, dim=t.dim() - 1)[rank]
                assert torch.equal(r[1][n], want), (rank, n)
    elif op == "read whole":
        assert got[1].keys() == full.keys() and all(torch.equal(got[1][n], full[n]) for n in full)
    elif op == "convert to hf":
        from safetensors.torch import load_file

        code, _, files = got[1]
        assert code == 0 and "model.safetensors.index.json" in files, files
        index = json.loads((root / "hf1" / "model.safetensors.index.json").read_text())
        back = {}
        for f in set(index["weight_map"].values()):
            back.update(load_file(str(root / "hf1" / f)))
        assert back.keys() == full.keys() and all(torch.equal(back[n], full[n]) for n in full)
    elif op.startswith(("inspect", "verify", "ls")):
        assert got[1][0] == 0, got[1]
        assert "model.norm.weight" in got[1][1] or op.startswith(("ls", "verify")), got[1][1][:500]
    elif op == "manifest":
        assert got[1]["step"] == STEP and sorted(got[1]["rng"]) == ["0", "1"]
        assert {f["rank"] for f in got[1]["files"].values()} == {0, 1}


@pytest.mark.parametrize("version", VERSIONS)
def test_a_tensor_without_elements_round_trips(tmp_path: Path, version: int) -> None:
    state = {"empty": torch.zeros(0), "cols": torch.zeros(3, 0), "w": torch.arange(4.0)}
    path = str(tmp_path / "c")
    ckpt.Checkpointer(async_save=False, format_version=version).save(path, step=1, model=state).result()
    reader = ckpt.open_checkpoint(path)
    assert reader.read("empty").shape == (0,) and reader.read("cols").shape == (3, 0)
    assert torch.equal(reader.read("w"), state["w"])
