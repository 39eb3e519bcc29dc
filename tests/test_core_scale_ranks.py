"""Local writer planning on 16 real gloo ranks: HSDP (4 x 4 mesh), FSDP (Shard(0) over 16) and DDP (plain tensors)
saves agree on their writers without exchanging descriptions, and restore exactly (the HSDP one written in format
v2 and restored lazily, each rank reading its own RNG state from its index); a rank whose state differs
makes the save fall back to the exact exchange, which names the tensor.

One spawned job does all the distributed work (small tensors, so that 16 processes fit a 2-core machine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_ranks

import ckpt
from ckpt import SaveOptions
from ckpt.errors import StateMismatchError

pytestmark = pytest.mark.timeout(300)
WORLD = 16


def values(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * 0.5 + seed


SHAPES = {f"w{i}": (rows, 3) for i, rows in enumerate((1, 5, 16, 17, 40, 3))}


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out: dict[str, Any] = {}
    c = ckpt.Checkpointer()
    hsdp = init_device_mesh("cpu", (4, 4), mesh_dim_names=("rep", "shard"))
    state = {
        n: distribute_tensor(values(i, s), hsdp, [Replicate(), Shard(0)])
        for i, (n, s) in enumerate(SHAPES.items())
    }
    v2 = ckpt.Checkpointer(format_version=2)  # the HSDP save in format v2: restored lazily below
    v2.save(f"{root}/hsdp", step=1, model=state).result()
    out["hsdp"] = v2.last_plan
    fsdp = init_device_mesh("cpu", (world,))
    state = {n: distribute_tensor(values(i, s), fsdp, [Shard(0)]) for i, (n, s) in enumerate(SHAPES.items())}
    c.save(f"{root}/fsdp", step=1, model=state, options=SaveOptions(rng=False)).result()
    out["fsdp"] = c.last_plan
    plain = {n: values(i, s) for i, (n, s) in enumerate(SHAPES.items())}
    res = c.save(f"{root}/ddp", step=1, model=plain, options=SaveOptions(rng=False)).result()
    out["ddp"] = c.last_plan
    out["ddp_bytes"] = res.bytes_written
    # the resharded restore: HSDP 16 -> FSDP 16 (every rank reads other ranks' boxes)
    back = {n: distribute_tensor(torch.zeros(s), fsdp, [Shard(0)]) for n, s in SHAPES.items()}
    res = ckpt.restore(f"{root}/hsdp", model=back)
    out["rng_restored"] = res.rng_restored
    out["restored"] = all(
        torch.equal(back[n].full_tensor(), values(i, s)) for i, (n, s) in enumerate(SHAPES.items())
    )
    # rank 5 holds another shape: the check fails on every rank, the exact path names the tensor
    odd = dict(plain)
    if rank == 5:
        odd["w2"] = values(2, (18, 3))
    try:
        c.save(f"{root}/odd", step=1, model=odd, options=SaveOptions(rng=False)).result()
        out["odd"] = "saved"
    except StateMismatchError as e:
        out["odd"] = str(e)
    out["odd_plan"] = c.last_plan
    return out


def test_sixteen_ranks_plan_locally_and_restore(tmp_path: Path) -> None:
    results = run_ranks(_job, WORLD, str(tmp_path), timeout=240)
    assert [r["hsdp"] for r in results] == ["local"] * WORLD
    assert [r["fsdp"] for r in results] == ["local"] * WORLD
    assert [r["ddp"] for r in results] == ["local"] * WORLD
    assert all(r["restored"] for r in results)
    assert all(r["rng_restored"][:3] == ["python", "numpy", "torch"] for r in results)
    assert json.loads((tmp_path / "hsdp" / "manifest.json").read_text())["format_version"] == 2
    assert len(list((tmp_path / "hsdp").glob("*.index.json"))) == WORLD
    for layout in ("hsdp", "fsdp", "ddp"):
        reader = ckpt.open_checkpoint(str(tmp_path / layout))
        for i, (n, s) in enumerate(SHAPES.items()):
            assert torch.equal(reader.read(n), values(i, s)), (layout, n)
        e = reader.manifest.tensors
        assert list(e) == list(SHAPES)  # the model's order
        boxes = [(t.name, sh.box) for t in e.values() for sh in t.shards if sh.box.numel]
        assert len(boxes) == len(set(boxes))  # no box stored twice
    # DDP: whole tensors spread over the ranks, not all on rank 0
    ddp = ckpt.open_checkpoint(str(tmp_path / "ddp")).manifest
    assert len({f.rank for f in ddp.files.values()}) == len(SHAPES)
    assert all("'w2'" in r["odd"] and "18" in r["odd"] for r in results), results[0]["odd"]
    assert {r["odd_plan"] for r in results} == {"exact"}
    assert not (tmp_path / "odd" / "manifest.json").exists()
