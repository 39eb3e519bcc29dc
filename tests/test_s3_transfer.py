"""S3 at line rate: multipart uploads from memory with parts in flight, parallel ranged GETs, threaded checksums.

Against the real moto server (and, where a fault is injected, through the loopback fault proxy). Part sizes are
set tiny (moto accepts 1 KiB parts here) so that many parts and many pieces run in a fraction of a second. Every
failure case checks the store itself, read from moto directly: nothing visible, no multipart upload left open.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch
from conftest import REAL_S3_URL
from hypothesis import given, settings
from hypothesis import strategies as st
from torture.faultproxy import Fault, fault_proxy

import ckpt
from ckpt.errors import CheckpointExistsError, CorruptionError, StorageError
from ckpt.storage import Read, open_storage
from ckpt.storage.multipart import multipart_etag, part_size
from ckpt.storage.ranged import plan_pieces
from ckpt.storage.s3 import S3Storage

PART = 64 << 10
NO_BOTO_RETRY = {"retries": {"max_attempts": 1, "mode": "standard"}}
needs_proxy = pytest.mark.skipif(
    bool(REAL_S3_URL), reason="the fault proxy speaks plain HTTP to loopback moto"
)


def storage(
    s3: Any, options: dict[str, Any] | None = None, retries: int = 5, in_flight: int = 4
) -> S3Storage:
    st_ = open_storage(f"{s3.url}/t", options if options is not None else s3.storage_options, retries=retries)
    assert isinstance(st_, S3Storage)
    st_.part_size = PART
    st_.parts_in_flight = st_.reads_in_flight = in_flight
    return st_


def keys(s3: Any) -> list[str]:
    resp = s3.boto3_client().list_objects_v2(Bucket=s3.bucket, Prefix=s3.prefix + "/")
    return sorted(o["Key"][len(s3.prefix) + 1 :] for o in resp.get("Contents", []))


def open_uploads(s3: Any) -> list[str]:
    return [u["Key"] for u in s3.boto3_client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])]


# ---------------------------------------------------------------------------------------------------- uploads
@pytest.mark.s3
@pytest.mark.parametrize("borrow", [False, True])
def test_multipart_from_memory_round_trip(s3: Any, borrow: bool) -> None:
    st_ = storage(s3)
    data = os.urandom(8 * PART + 12345)
    rng = random.Random(0)
    scratch = bytearray(3 * PART)
    with st_.create("big.bin", borrow=borrow) as f:
        pos = 0
        while pos < len(data):  # writes that straddle part boundaries, and one larger than a part
            n = min(rng.choice([1, 777, PART - 3, 3 * PART]), len(data) - pos)
            if borrow:
                f.write(memoryview(data)[pos : pos + n])
            else:  # a file's contract: the caller reuses its buffer as soon as write returns
                scratch[:n] = data[pos : pos + n]
                f.write(memoryview(scratch)[:n])
                scratch[:n] = bytes(n)
            pos += n
    head = s3.boto3_client().head_object(Bucket=s3.bucket, Key=f"{s3.prefix}/t/big.bin")
    assert head["ETag"].strip('"').endswith("-9")
    assert st_.read_bytes("big.bin") == data
    # one part or less: a single PUT, not a multipart upload
    st_.put_bytes("small.bin", data[:PART])
    head = s3.boto3_client().head_object(Bucket=s3.bucket, Key=f"{s3.prefix}/t/small.bin")
    assert "-" not in head["ETag"] and st_.read_bytes("small.bin") == data[:PART]
    assert open_uploads(s3) == []


def test_part_sizes_grow_to_fit_five_tib() -> None:
    base = 16 << 20
    assert part_size(base, 1) == part_size(base, 1000) == base
    assert part_size(base, 1001) == 2 * base
    assert part_size(base, 10_000) == 5 << 30
    assert sum(part_size(base, i) for i in range(1, 10_001)) >= 5 << 40
    # S3's documented multipart ETag: md5 of the parts' binary md5s, then "-<parts>"
    assert multipart_etag(['"0123456789abcdef0123456789abcdef"']).endswith('-1"')


@pytest.mark.s3
@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_exception_in_the_block_aborts_the_upload(s3: Any, error: type[BaseException]) -> None:
    st_ = storage(s3)
    with pytest.raises(error):
        with st_.create("x.bin") as f:
            for _ in range(6):  # parts 1-5 submitted, some still in flight
                f.write(os.urandom(PART))
            raise error("interrupted")
    assert keys(s3) == [] and open_uploads(s3) == []


@pytest.mark.s3
def test_create_only_refuses_an_existing_name_and_aborts(s3: Any) -> None:
    st_ = storage(s3)
    st_.put_bytes("taken.bin", b"theirs")
    with pytest.raises(CheckpointExistsError, match="taken.bin already exists"):
        with st_.create("taken.bin") as f:
            f.write(os.urandom(3 * PART))
    assert st_.read_bytes("taken.bin") == b"theirs"
    assert open_uploads(s3) == []


@pytest.mark.s3
@needs_proxy
def test_a_part_failing_while_others_are_in_flight_aborts_after_them(s3: Any) -> None:
    # part 3 always fails; every other part is slow, so parts 1, 2 and 4 are in flight when it does. The upload is
    # aborted only after they finished (a part landing after the abort would keep storage billed), nothing is
    # published, nothing stays open.
    faults = [
        Fault("error", method="PUT", path="partNumber=3", status=500),
        Fault("delay", method="PUT", path="partNumber=", seconds=0.3),
    ]
    with fault_proxy(s3.endpoint, faults) as proxy:
        options = {"client_kwargs": {"endpoint_url": proxy.url}, "config_kwargs": NO_BOTO_RETRY}
        st_ = storage(s3, options, retries=1)
        with pytest.raises(StorageError, match=r"uploading part 3 of s3://\S+/t/big\.bin failed") as info:
            with st_.create("big.bin") as f:
                for _ in range(8):
                    f.write(os.urandom(PART))
        assert "\n" not in str(info.value)
        assert (
            proxy.count("error 500", "PUT", "partNumber=3") >= 2
        )  # the try and ckpt's retry (s3fs adds its own)
        log = [(r.method, r.target, r.action) for r in proxy.log]
        abort = next(i for i, (m, t, _) in enumerate(log) if m == "DELETE" and "uploadId=" in t)
        parts = [i for i, (m, t, a) in enumerate(log) if m == "PUT" and "partNumber=" in t and a == "delay"]
        assert len(parts) >= 3 and max(parts) < abort
    assert keys(s3) == [] and open_uploads(s3) == []


@pytest.mark.s3
@needs_proxy
def test_lost_response_to_the_completion_still_publishes(s3: Any) -> None:
    # the server completes the upload but the answer is lost; the retry finds the upload gone and the object's
    # ETag is the one our parts make: published, not reported as a failure
    data = os.urandom(3 * PART + 5)
    faults = [Fault("drop_response", method="POST", path="uploadId=", nth={1})]
    with fault_proxy(s3.endpoint, faults) as proxy:
        options = {"client_kwargs": {"endpoint_url": proxy.url}, "config_kwargs": NO_BOTO_RETRY}
        st_ = storage(s3, options)
        with st_.create("done.bin") as f:
            f.write(data)
        assert proxy.count("drop_response") == 1
    assert storage(s3).read_bytes("done.bin") == data and open_uploads(s3) == []


# ---------------------------------------------------------------------------------------------------- reads
@settings(max_examples=200, deadline=None)
@given(
    spans=st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 300), st.integers(0, 120)), max_size=12),
    max_piece=st.integers(1, 200),
)
def test_pieces_cover_every_read_exactly_once(spans: list[tuple[str, int, int]], max_piece: int) -> None:
    reads = [Read(rel, start, memoryview(bytearray(n))) for rel, start, n in spans]
    pieces = plan_pieces(reads, max_piece)
    seen = [bytearray(len(r.out)) for r in reads]
    for p in pieces:
        assert 0 < p.length <= max_piece
        assert sum(n for *_, n in p.spans) == p.length
        at = 0
        for i, off, poff, n in p.spans:
            assert poff == at and reads[i].rel == p.rel and reads[i].start + off == p.start + poff
            at += n
            for k in range(off, off + n):
                seen[i][k] += 1
    assert all(set(s) <= {1} and len(s) == len(r.out) for s, r in zip(seen, reads, strict=True))


@pytest.mark.s3
@needs_proxy
def test_parallel_ranged_gets_fill_the_destinations(s3: Any) -> None:
    files = {name: os.urandom(5 * PART + 11) for name in ("a.bin", "b.bin")}
    for name, data in files.items():
        storage(s3).put_bytes(name, data)
    rng = random.Random(1)
    wanted = [("a.bin", 0, 100), ("a.bin", 100, 2 * PART), ("a.bin", 2 * PART + 100, PART)]  # back to back
    wanted += [("b.bin", 7, 0), ("b.bin", 3 * PART, 2 * PART + 11), ("b.bin", 10, 5000), ("a.bin", 17, 300)]
    rng.shuffle(wanted)
    reads = [Read(rel, start, memoryview(bytearray(n))) for rel, start, n in wanted]
    with fault_proxy(s3.endpoint, []) as proxy:
        st_ = storage(s3, {"client_kwargs": {"endpoint_url": proxy.url}})
        st_.read_piece = PART
        blocks: list[tuple[int, int]] = []
        st_.read_many(reads, lambda i, b: blocks.append((i, len(b))))
        gets = proxy.count("forward", "GET")
    for (rel, start, n), r in zip(wanted, reads, strict=True):
        assert bytes(r.out) == files[rel][start : start + n]
    assert sorted(blocks) == sorted((i, len(r.out)) for i, r in enumerate(reads) if len(r.out))
    assert gets == len(plan_pieces(reads, PART)) < sum(1 for r in reads if len(r.out)) + 4


@pytest.mark.s3
def test_ranged_read_past_the_end_names_the_file(s3: Any) -> None:
    st_ = storage(s3)
    st_.put_bytes("short.bin", b"x" * 100)
    from ckpt.storage import ReadFailed

    with pytest.raises(ReadFailed) as info:
        st_.read_many(
            [
                Read("short.bin", 0, memoryview(bytearray(50))),
                Read("short.bin", 90, memoryview(bytearray(20))),
            ]
        )
    assert info.value.index == 1 and "short.bin: short read" in str(info.value.error)


# ---------------------------------------------------------------------------------------------------- checksums
def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        f"w{i}": torch.randn(256, 512, generator=g) for i in range(3)
    }  # 512 KiB each: hashed on the thread


def _flip_byte(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]


def test_checksum_mismatch_with_threaded_hashing_local(tmp_path: Any) -> None:
    path = str(tmp_path / "c")
    state = _state()
    ckpt.save(path, step=1, model=state, rng=False)
    back = {k: torch.empty_like(v) for k, v in state.items()}
    ckpt.restore(path, model=back, rng=False)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    m = ckpt.open_checkpoint(path).manifest
    shard = m.tensors["w1"].shards[0]
    data_file = os.path.join(path, shard.file)
    with open(data_file, "r+b") as f:
        f.seek(shard.offset + shard.nbytes // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CorruptionError, match=rf"{shard.file}: tensor 'w1' .*checksum mismatch") as info:
        ckpt.restore(path, model=back, rng=False)
    assert "\n" not in str(info.value)
    ckpt.restore(path, model=back, rng=False, verify=False)  # the bytes are read all the same


@pytest.mark.s3
def test_checksum_mismatch_with_threaded_hashing_s3(s3: Any) -> None:
    url = f"{s3.url}/c"
    state = _state()
    ckpt.save(url, step=1, model=state, rng=False, storage_options=s3.storage_options)
    m = ckpt.open_checkpoint(url, s3.storage_options).manifest
    shard = m.tensors["w2"].shards[0]
    client, key = s3.boto3_client(), f"{s3.prefix}/c/{shard.file}"
    data = client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    client.put_object(Bucket=s3.bucket, Key=key, Body=_flip_byte(data, shard.offset + 3))
    back = {k: torch.empty_like(v) for k, v in state.items()}
    with pytest.raises(CorruptionError, match=rf"/c/{shard.file}: tensor 'w2' .*checksum mismatch") as info:
        ckpt.restore(url, model=back, rng=False, storage_options=s3.storage_options)
    assert "\n" not in str(info.value)
    client.delete_object(Bucket=s3.bucket, Key=key)
    with pytest.raises(CorruptionError, match=rf"/c/{shard.file}: missing \(holds tensor 'w\d'\)"):
        ckpt.restore(url, model=back, rng=False, storage_options=s3.storage_options)


@pytest.mark.s3
def test_model_and_optimizer_restore_through_batched_reads(s3: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    url = f"{s3.url}/m"
    ckpt.save(url, step=3, model=model, optimizer=opt, rng=False, storage_options=s3.storage_options)
    model2 = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
    opt2 = torch.optim.Adam(model2.parameters())
    ckpt.restore(url, model=model2, optimizer=opt2, rng=False, storage_options=s3.storage_options)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True)
    )
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[i][k], s2[i][k]) for i in s1 for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.s3
def test_retention_aborts_stale_uploads_but_not_a_later_steps(s3: Any) -> None:
    # step 9's upload may be another rank's save at work: retention after committing step 2 must not abort it
    client = s3.boto3_client()
    for key in ("step_00000001/r00000-old.safetensors", "step_00000009/r00001-live.safetensors", "stray.bin"):
        client.create_multipart_upload(Bucket=s3.bucket, Key=f"{s3.prefix}/{key}")
    mgr = ckpt.CheckpointManager(s3.url, storage_options=s3.storage_options, async_save=False, keep_last=1)
    mgr.save(2, model={"w": torch.zeros(4)})
    assert open_uploads(s3) == [f"{s3.prefix}/step_00000009/r00001-live.safetensors"]
