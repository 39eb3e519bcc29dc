"""The DCP source reads only what a slice needs, from a checkpoint ``dcp.save`` wrote on 3 FSDP2 gloo ranks.

FSDP2 shards every tensor along dim 0 over the ranks, unevenly here ([7, 10] as 3 + 3 + 1 rows), so each tensor is
stored as 3 chunks in 3 ``.distcp`` files.  Asserted against the full tensors (``full_tensor()`` on the ranks):

* a slice inside one chunk is a view of the memory-mapped ``.distcp`` file (``read_anon`` 0, and its data pointer
  lies in the file's map), exact;
* a slice spanning chunks (rows across a shard boundary, columns across all shards, the whole tensor) is exact and
  costs exactly its own bytes (``read_anon``);
* ``convert`` DCP -> our format is bit-exact (model and Adam moments), and a truncated ``.distcp`` is refused with a
  one-line error naming the file.
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
import torch
from ckpt.converters.convert import ConvertOptions, convert
from ckpt.converters.dcp import DCPSource

from ckpt import open_checkpoint
from ckpt.errors import CorruptionError
from ckpt.layouts import Piece, bit_equal
from tests.conftest import run_ranks

pytestmark = pytest.mark.timeout(300)
WORLD = 3


def _save_fsdp(rank: int, world: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/dcp")
    full = {n: t.full_tensor() for n, t in msd.items()}
    for param, st in osd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"optim/{param}/{key}"] = st[key].full_tensor()
    if rank == 0:
        torch.save(full, f"{out}/full.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("dcp_fsdp")
    run_ranks(_save_fsdp, WORLD, str(root))
    return root / "dcp", torch.load(root / "full.pt", weights_only=True)


def _in_map(src: DCPSource, t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes lie inside one of the source's memory-mapped ``.distcp`` files."""
    for mm in src._maps.values():
        if mm is None:
            continue
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        if base <= t.data_ptr() < base + len(mm):
            return True
    return False


def test_slices_are_views_inside_a_chunk_and_exact_across_chunks(saved: tuple[Path, dict]) -> None:
    path, full = saved
    assert len(list(path.glob("*.distcp"))) == WORLD
    src = DCPSource(path)
    try:
        assert set(src.tensors) == set(full)
        for name, want in full.items():
            rows = want.shape[0]
            assert rows in (5, 7)  # sharded 2+2+1 / 3+3+1 over 3 ranks
            inside = Piece(name, None, 0, 1, 1)  # row 1, in rank 0's chunk
            got = src.read(inside)
            assert src.read_anon(inside) == 0, name
            assert _in_map(src, got), f"{name}: a slice inside one chunk is not a view of the mapped file"
            assert bit_equal(got, want[1:2]), name
            spans = [Piece(name, None, 0, 1, 3), Piece(name, None, None)]  # rows 1-3 cross a shard boundary
            if want.dim() == 2:
                spans.append(Piece(name, None, 1, 2, 3))  # columns 2-4 of every row (all chunks)
            for p in spans:
                got = src.read(p)
                assert src.read_anon(p) == src.piece_bytes(p) == got.numel() * got.element_size(), (name, p)
                sl = want if p.dim is None else want.narrow(p.dim, p.start, p.length)
                assert bit_equal(got, sl), (name, p)
    finally:
        src.close()


def test_convert_fsdp_dcp_to_ckpt_is_exact(saved: tuple[Path, dict], tmp_path: Path) -> None:
    path, full = saved
    out = tmp_path / "ours"
    convert(str(path), str(out), ConvertOptions(to="cuda", from_="cuda", step=1))
    r = open_checkpoint(str(out))
    for name, want in full.items():
        assert bit_equal(r.read(name), want), name


def test_truncated_distcp_is_refused_naming_the_file(saved: tuple[Path, dict], tmp_path: Path) -> None:
    path, _ = saved
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    victim = sorted(bad.glob("*.distcp"))[1]
    victim.write_bytes(victim.read_bytes()[:200])
    with pytest.raises(CorruptionError, match=victim.name) as e:
        convert(str(bad), str(tmp_path / "out"), ConvertOptions(to="cuda", from_="cuda", step=1))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
