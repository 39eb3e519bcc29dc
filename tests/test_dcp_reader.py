"""``dcp.load(state_dict, storage_reader=ckpt.dcp.Reader(path))`` on real gloo ranks, against ``ckpt.restore``.

A checkpoint saved by one plain process and one saved FSDP2-sharded on 2 ranks are loaded through DCP's own
planner into FSDP2 DTensors on 2 and on 4 ranks (different shardings than they were saved with: DCP reshards,
the reader serves the boxes), and every local shard, model and Adam moments, must equal what ``ckpt.restore``
puts in the same sharding, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import run_ranks
from test_core_multirank import Net, make  # the same small model as the multi-rank restore tests

import ckpt
from ckpt.state.training import optim_name

pytestmark = pytest.mark.timeout(300)


def shard(model: Net, world: int) -> Net:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for m in (model.inp, model.out, model):
        fully_shard(m, mesh=mesh)
    return model


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> None:
    for step in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def full(t: Any) -> Any:
    """The whole value of a DTensor (collective), anything else as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def load_both(path: str, world: int) -> tuple[int, list[str]]:
    """DCP-load ``path`` and ckpt-restore it into the same FSDP2 sharding; (tensors compared, mismatches)."""
    import torch.distributed.checkpoint as dcp

    from ckpt.dcp import Reader

    model = shard(make(seed=7), world)
    sd: dict[str, Any] = dict(model.state_dict())
    for n, p in model.named_parameters():
        sd[optim_name(n, "exp_avg")] = torch.zeros_like(p)
        sd[optim_name(n, "exp_avg_sq")] = torch.zeros_like(p)
    dcp.load(sd, storage_reader=Reader(path))

    ref = shard(make(seed=8), world)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    ckpt.restore(path, model=ref, optimizer=opt, rng=False)
    want: dict[str, Any] = dict(ref.state_dict())
    for n, p in ref.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            want[optim_name(n, key)] = opt.state[p][key]
    bad = [k for k in want if not torch.equal(local(sd[k]), local(want[k]))]
    assert set(sd) == set(want)
    return len(want), bad


def job2(rank: int, world: int, tmp: str) -> Any:
    torch.set_num_threads(1)
    d = Path(tmp)
    m = shard(make(seed=0), world)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    train(m, opt, rank, steps=2)
    ckpt.save(str(d / "fsdp2"), step=2, model=m, optimizer=opt)
    # The other direction: dcp.save through ckpt's Writer, from the same sharded state.
    import torch.distributed.checkpoint as dcp

    from ckpt.dcp import Writer

    sd: dict[str, Any] = dict(m.state_dict())
    for n, p in m.named_parameters():
        sd[optim_name(n, "exp_avg")] = opt.state[p]["exp_avg"]
    sd["train_state"] = {"step": 2, "tokens": 4096}
    dcp.save(sd, storage_writer=Writer(str(d / "dcp-written"), step=2))
    whole = {k: full(v) for k, v in sd.items()}
    if rank == 0:
        torch.save(whole, d / "dcp-written.pt")
    return load_both(str(d / "single"), world), load_both(str(d / "fsdp2"), world)


def load_written(path: str, world: int) -> list[str]:
    """DCP-load what the Writer wrote into a fresh 4-rank sharding; names of the values that differ."""
    import torch.distributed.checkpoint as dcp

    from ckpt.dcp import Reader

    model = shard(make(seed=9), world)
    sd: dict[str, Any] = dict(model.state_dict())
    for n, p in model.named_parameters():
        sd[optim_name(n, "exp_avg")] = torch.zeros_like(p)
    sd["train_state"] = {"step": 0, "tokens": 0}
    dcp.load(sd, storage_reader=Reader(path))
    want = torch.load(Path(path).with_suffix(".pt"))
    bad = [k for k, v in want.items() if k != "train_state" and not torch.equal(full(sd[k]), v)]
    return bad + ([] if sd["train_state"] == {"step": 2, "tokens": 4096} else ["train_state"])


def job4(rank: int, world: int, tmp: str) -> Any:
    torch.set_num_threads(1)
    d = Path(tmp)
    return (
        load_both(str(d / "fsdp2"), world),
        load_both(str(d / "single"), world),
        load_written(str(d / "dcp-written"), world),
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dcp-reader")
    m = make(seed=1)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train(m, opt, 0, steps=3)
    ckpt.save(str(d / "single"), step=3, model=m, optimizer=opt)
    return d


def test_dcp_load_reshards_into_dtensors_on_2_then_4_ranks(saved: Path) -> None:
    for world, job in ((2, job2), (4, job4)):
        for per_rank in run_ranks(job, world, str(saved)):
            if world == 4:
                *per_rank, written_bad = per_rank
                assert written_bad == []
            for n, bad in per_rank:
                assert n == 19 and bad == [], (world, bad)  # 6 parameters + 1 buffer + 2 Adam moments each


def test_reader_metadata_lists_stored_boxes_and_prefix(saved: Path) -> None:
    from ckpt.dcp import Reader

    md = Reader(saved / "single", prefix="model.").read_metadata().state_dict_metadata
    assert "model.inp.weight" in md and "optim/inp.weight/exp_avg" in md and "inp.weight" not in md
    assert md["model.inp.weight"].size == torch.Size([10, 6])
    assert Reader.validate_checkpoint_id(saved / "single") and not Reader.validate_checkpoint_id(saved)


def test_reader_is_reachable_as_ckpt_dcp() -> None:
    import ckpt as c

    assert c.dcp.Reader.__name__ == "Reader"


def test_dcp_save_through_the_writer_is_a_ckpt_checkpoint(saved: Path) -> None:
    """What ``dcp.save(..., storage_writer=Writer(...))`` wrote on 2 ranks (by the test above) restores with
    ckpt in one plain process: every tensor equal to the saving job's full tensors; the non-tensor values are
    JSON in the manifest, not pickles."""
    path = saved / "dcp-written"
    if not (path / "manifest.json").exists():
        pytest.skip("needs test_dcp_load_reshards_into_dtensors_on_2_then_4_ranks")
    want = torch.load(saved / "dcp-written.pt")
    m = make(seed=5)
    res = ckpt.restore(str(path), model=m, rng=False)
    assert res.step == 2
    for k, v in m.state_dict().items():
        assert torch.equal(v, want[k]), k
    r = ckpt.CheckpointReader(str(path))
    assert r.manifest.layout.world_size == 2 and r.manifest.user == {
        "dcp": {"train_state.step": 2, "train_state.tokens": 4096}
    }
    e = r.entry(optim_name("inp.weight", "exp_avg"))
    assert e.role == "optimizer_state" and e.param == "inp.weight" and len(e.shards) == 2
    assert torch.equal(r.read(optim_name("inp.weight", "exp_avg")), want[optim_name("inp.weight", "exp_avg")])
