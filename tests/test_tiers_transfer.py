"""``ckpt.tiers.transfer.transfer`` on 2 real gloo ranks: files go from a mapping on one rank straight into a temp
file beside their final name on the other, and get that name only when they hash to what their sender hashed.

Every case runs in one spawned job (gloo start-up is the slow part): rank 0 sends, rank 1 receives, each case into
a folder of its own; rank 1 reports what its folder holds afterwards, temp files included.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from conftest import run_ranks

pytestmark = pytest.mark.timeout(300)

SIZES = {"a.bin": 3 << 20, "b.bin": 4097, "empty.bin": 0}


def payload(name: str, size: int) -> bytes:
    """Bytes that differ per file and per position (a shifted or swapped file cannot pass for another)."""
    seed = sum(name.encode())
    return (
        bytes((i * 131 + seed + (i >> 12)) & 0xFF for i in range(size)) if size < 8192 else _big(seed, size)
    )


def _big(seed: int, size: int) -> bytes:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy().tobytes()


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def one_case(
    coll: Any, tmp: Path, case: str, sizes: dict[str, int], damage: str | None = None
) -> dict[str, Any]:
    """Rank 0 writes ``sizes``' files into ``<case>/send`` and sends them all to rank 1, which lands them in
    ``<case>/recv``.  ``damage``: "wire" flips one bit of what rank 1 received of ``a.bin``, after the receive;
    "missing" / "short": rank 0 has no / a shorter ``a.bin`` than the sizes say."""
    from ckpt.tiers.landing import Landing
    from ckpt.tiers.transfer import Receive, Send, transfer

    send, recv = tmp / case / "send", tmp / case / "recv"
    if coll.rank == 0:
        send.mkdir(parents=True)
        for n, size in sizes.items():
            if (n, damage) == ("a.bin", "missing"):
                continue
            data = payload(n, size)
            (send / n).write_bytes(data[: size // 2] if (n, damage) == ("a.bin", "short") else data)
    sends = [Send(n, send / n, size, 1) for n, size in sizes.items()] if coll.rank == 0 else []
    recvs = [Receive(n, recv / n, size, 0) for n, size in sizes.items()] if coll.rank == 1 else []
    real = Landing.publish

    def flip(self: Landing, sent: str | None) -> str | None:
        if self.path.name == "a.bin":
            self.tensor[self.size // 3] ^= 4
        return real(self, sent)

    if damage == "wire":
        Landing.publish = flip  # type: ignore[method-assign]
    try:
        got = transfer(coll, sends, recvs)
    finally:
        Landing.publish = real  # type: ignore[method-assign]
    out: dict[str, Any] = {"kept": got.kept, "problems": got.problems, "listing": listing(recv)}
    if coll.rank == 1:
        out["bytes_ok"] = {n: (recv / n).read_bytes() == payload(n, sizes[n]) for n in got.kept}
    else:
        out["sent_intact"] = {
            n: (send / n).read_bytes() == payload(n, s) for n, s in sizes.items() if (send / n).exists()
        }
    return out


def transfer_job(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    from ckpt.distributed import Collective

    coll = Collective(dist.new_group(backend="gloo"))
    root = Path(tmp)
    out = {
        "exact": one_case(coll, root, "exact", SIZES),
        "wire": one_case(coll, root, "wire", SIZES, "wire"),
        "missing": one_case(coll, root, "missing", SIZES, "missing"),
        "short": one_case(coll, root, "short", SIZES, "short"),
        "empty": one_case(coll, root, "empty", {"e1": 0, "e2": 0}),
    }
    # a file that cannot land (its folder is a file): the sender is not left waiting, the receiver reports it
    blocked = root / "blocked"
    if rank == 1:
        blocked.mkdir()
        (blocked / "recv").write_bytes(b"not a folder")
    dist.barrier()
    out["blocked"] = one_case(coll, root, "blocked", {"a.bin": 1 << 20})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(transfer_job, 2, str(tmp_path_factory.mktemp("transfer")))


def test_files_arrive_bit_exact_under_their_names_and_nothing_else(runs: list[dict[str, Any]]) -> None:
    sender, receiver = runs[0]["exact"], runs[1]["exact"]
    assert sender["problems"] == [] and receiver["problems"] == []
    assert sorted(receiver["kept"]) == sorted(SIZES)
    assert receiver["bytes_ok"] == dict.fromkeys(SIZES, True)
    assert receiver["listing"] == sorted(SIZES)  # no temp file left beside them
    assert sender["sent_intact"] == dict.fromkeys(SIZES, True)  # the private mapping never wrote to the file


def test_a_file_damaged_in_transit_is_refused_and_leaves_nothing(runs: list[dict[str, Any]]) -> None:
    got = runs[1]["wire"]
    assert got["kept"] == ["b.bin", "empty.bin"]
    assert got["bytes_ok"] == {"b.bin": True, "empty.bin": True}
    assert len(got["problems"]) == 1 and "a.bin: damaged in transit" in got["problems"][0]
    assert got["listing"] == ["b.bin", "empty.bin"]  # neither a.bin nor its temp file
    assert runs[0]["wire"]["problems"] == []


@pytest.mark.parametrize("case", ["missing", "short"])
def test_a_sender_that_cannot_read_its_file_sends_zeros_that_are_refused(
    runs: list[dict[str, Any]], case: str
) -> None:
    sender, receiver = runs[0][case], runs[1][case]
    assert len(sender["problems"]) == 1 and "a.bin" in sender["problems"][0]
    assert ("cannot read" if case == "missing" else "the manifest says") in sender["problems"][0]
    assert receiver["kept"] == ["b.bin", "empty.bin"]
    assert receiver["bytes_ok"] == {"b.bin": True, "empty.bin": True}
    assert len(receiver["problems"]) == 1 and "could not read it" in receiver["problems"][0]
    assert receiver["listing"] == ["b.bin", "empty.bin"]


def test_empty_files_arrive_empty(runs: list[dict[str, Any]]) -> None:
    got = runs[1]["empty"]
    assert got["problems"] == [] and sorted(got["kept"]) == ["e1", "e2"]
    assert got["bytes_ok"] == {"e1": True, "e2": True} and got["listing"] == ["e1", "e2"]


def test_a_file_that_cannot_land_is_reported_and_the_sender_is_not_left_waiting(
    runs: list[dict[str, Any]],
) -> None:
    sender, receiver = runs[0]["blocked"], runs[1]["blocked"]
    assert sender["problems"] == []
    assert receiver["kept"] == [] and len(receiver["problems"]) == 1
    assert "a.bin: cannot receive" in receiver["problems"][0]


def test_a_refused_landing_removes_its_temp_file(tmp_path: Path) -> None:
    """In one process: a landing whose digest does not match removes its temp file; a matching one is renamed
    (and replaces an older file of that name, as the put it replaces did)."""
    from ckpt.format.codecs import checksum
    from ckpt.tiers.landing import Landing

    data = payload("x", 5000)
    bad = Landing(tmp_path / "x", len(data))
    assert bad.tmp.exists() and bad.tmp.stat().st_size == len(data)
    bad.tensor.numpy()[:] = memoryview(data)
    assert bad.publish(checksum(data[:-1] + b"\0")) is not None
    assert listing(tmp_path) == []
    (tmp_path / "x").write_bytes(b"old")
    good = Landing(tmp_path / "x", len(data))
    good.tensor.numpy()[:] = memoryview(data)
    assert good.publish(checksum(data)) is None
    assert listing(tmp_path) == ["x"] and (tmp_path / "x").read_bytes() == data
