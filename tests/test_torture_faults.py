"""Object-store faults: a loopback proxy between s3fs and moto injects 5xx/SlowDown, resets and slow responses.

Most tests turn botocore's own retries off (``max_attempts: 1``) so that each injected fault reaches ckpt's retry
layer (``ckpt.storage.retry.with_retries``) and the request counts are exact; one test keeps the default botocore configuration to
show the layers together. Every test checks the wire (the proxy's request log) and the store itself (moto, read
directly, not through the proxy): what was committed, and that no multipart upload is left open.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import REAL_S3_URL
from torture.faultproxy import Fault, FaultProxy, fault_proxy

import ckpt
from ckpt.errors import CkptError, StorageError
from ckpt.restoring.discovery import list_checkpoints
from ckpt.storage import open_storage

pytestmark = [
    pytest.mark.s3,
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        bool(REAL_S3_URL), reason="the fault proxy speaks plain HTTP to a loopback moto server"
    ),
]

NO_BOTO_RETRY = {"retries": {"max_attempts": 1, "mode": "standard"}}


@contextlib.contextmanager
def proxied(
    s3: Any, faults: list[Fault], botocore_retries: bool = False
) -> Iterator[tuple[FaultProxy, dict]]:
    """A proxy in front of the test's moto server, and storage options that go through it."""
    with fault_proxy(s3.endpoint, faults, seed=1) as proxy:
        options: dict[str, Any] = {"client_kwargs": {"endpoint_url": proxy.url}}
        if not botocore_retries:
            options["config_kwargs"] = NO_BOTO_RETRY
        yield proxy, options


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def keys(s3: Any) -> list[str]:
    """Object keys under the test prefix, read from moto directly (not through the proxy)."""
    resp = s3.boto3_client().list_objects_v2(Bucket=s3.bucket, Prefix=s3.prefix + "/")
    return sorted(o["Key"][len(s3.prefix) + 1 :] for o in resp.get("Contents", []))


def open_uploads(s3: Any) -> list[str]:
    return [u["Key"] for u in s3.boto3_client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])]


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("status", [500, 503])
def test_save_retries_server_errors_and_commits(s3: Any, status: int) -> None:
    # 3 consecutive errors on the data file PUT: each one is a ckpt-level retry (botocore retries are off).
    # Before the fix, a 500 was not retried: s3fs turns it into OSError(EREMOTEIO, "We encountered an internal
    # error...") and the classifier only looked for "500"/"InternalError" in the text.
    faults = [Fault("error", method="PUT", path=".safetensors", nth={1, 2, 3}, status=status)]
    with proxied(s3, faults) as (proxy, options):
        m = model()
        mgr = ckpt.CheckpointManager(s3.url, storage_options=options, async_save=True)
        mgr.save(1, model=m)
        mgr.wait()
        assert proxy.count(f"error {status}", "PUT") == 3
        assert proxy.count("forward", "PUT", ".safetensors") == 1
        back = model()
        for p in back.parameters():
            torch.nn.init.zeros_(p)
        assert mgr.restore_latest(model=back) == 1
        assert same(m, back)
        mgr.close()
    assert "step_00000001/manifest.json" in keys(s3)


def test_save_gives_up_after_the_retry_limit_without_committing(s3: Any) -> None:
    faults = [Fault("error", method="PUT", path=".safetensors", status=500)]
    with proxied(s3, faults) as (proxy, options):
        # requests one ckpt-level attempt costs (the layers below still retry once even with max_attempts=1)
        with pytest.raises(StorageError):
            open_storage(s3.url, options, retries=0).put_bytes("probe/x.safetensors", b"x")
        per_attempt = proxy.count("error 500", "PUT")
        mgr = ckpt.CheckpointManager(s3.url, storage_options=options, async_save=False)
        with pytest.raises(CkptError, match=r"not committed.*r00000-\w+\.safetensors failed") as info:
            mgr.save(1, model=model())
        assert "\n" not in str(info.value)
        assert proxy.count("error 500", "PUT") == per_attempt * (1 + open_storage(s3.url).retries + 1)
        assert proxy.count("forward", "PUT") == 0
    assert not [k for k in keys(s3) if k.endswith("manifest.json")]
    assert [i.status for i in list_checkpoints(s3.url, storage_options=s3.storage_options)] in (
        [],
        ["uncommitted"],
    )
    assert open_uploads(s3) == []


def test_manifest_put_failing_leaves_data_but_no_checkpoint(s3: Any) -> None:
    # (500, not 503: s3fs retries SlowDown itself with backoff, which only makes an always-failing case slow)
    faults = [Fault("error", method="PUT", path="manifest.json", status=500)]
    with proxied(s3, faults) as (proxy, options):
        mgr = ckpt.CheckpointManager(s3.url, storage_options=options, async_save=True)
        mgr.save(1, model=model())
        with pytest.raises(CkptError, match="rank 0 commit.*manifest.json"):
            mgr.wait()
        assert proxy.count("error 500", "PUT", "manifest.json") > open_storage(s3.url).retries
        mgr.checkpointer.stager.release()
    assert [k for k in keys(s3) if k.endswith(".safetensors")] and not [
        k for k in keys(s3) if k.endswith("manifest.json")
    ]
    assert [i.status for i in list_checkpoints(s3.url, storage_options=s3.storage_options)] == ["uncommitted"]


def test_lost_response_to_the_manifest_put_still_commits(s3: Any) -> None:
    # The server applies the create-only PUT but the client never hears back; the retry then finds the object.
    # Before the fix that was reported as "already exists" and the save as failed although it was committed.
    faults = [Fault("drop_response", method="PUT", path="manifest.json", nth={1})]
    with proxied(s3, faults, botocore_retries=True) as (proxy, options):
        mgr = ckpt.CheckpointManager(s3.url, storage_options=options, async_save=False)
        result = mgr.save(1, model=model()).result()
        assert result.step == 1
        assert proxy.count("drop_response") == 1
        # a genuinely different manifest for the same step is still refused
        with pytest.raises(CkptError, match="already exists"):
            mgr.save(1, model=model())
    assert "step_00000001/manifest.json" in keys(s3)


def test_format_v2_index_faults_commit_or_leave_no_checkpoint(s3: Any) -> None:
    """Format v2 writes each rank's index (create-only) before the top manifest: a lost response to the index PUT
    is retried and the save commits; an index PUT that keeps failing leaves no manifest.json (not committed)."""
    lost = [Fault("drop_response", method="PUT", path=".index.json", nth={1})]
    with proxied(s3, lost, botocore_retries=True) as (proxy, options):
        mgr = ckpt.CheckpointManager(s3.url, storage_options=options, async_save=False, format_version=2)
        m = model()
        assert mgr.save(1, model=m).result().step == 1
        assert proxy.count("drop_response") == 1
        back = ckpt.open_checkpoint(f"{s3.url}/step_00000001", options)
        assert torch.equal(back.read("0.weight"), m.state_dict()["0.weight"])
    assert "step_00000001/manifest.json" in keys(s3)
    assert [k for k in keys(s3) if k.startswith("step_00000001/") and k.endswith(".index.json")]
    failing = [Fault("error", method="PUT", path=".index.json", status=500)]
    with proxied(s3, failing) as (proxy, options):
        mgr = ckpt.CheckpointManager(s3.url, storage_options=options, async_save=False, format_version=2)
        with pytest.raises(CkptError, match=r"index\.json") as info:
            mgr.save(2, model=model())
        assert "\n" not in str(info.value)
    assert not [k for k in keys(s3) if k.startswith("step_00000002/") and k.endswith("manifest.json")]
    assert open_uploads(s3) == []


def test_connection_reset_mid_upload_is_retried(s3: Any) -> None:
    faults = [Fault("reset", method="PUT", path=".safetensors", nth={1, 2}, body_fraction=0.3)]
    with proxied(s3, faults) as (proxy, options):
        m = model()
        ckpt.save(f"{s3.url}/step_00000001", step=1, model=m, storage_options=options)
        assert proxy.count("reset") == 2
        back = ckpt.open_checkpoint(f"{s3.url}/step_00000001", options)
        assert torch.equal(back.read("0.weight"), m.state_dict()["0.weight"])
    assert open_uploads(s3) == []


def test_multipart_upload_failure_is_aborted_or_swept(s3: Any, tmp_path: Any) -> None:
    # > 2 x 50 MiB: s3fs uploads it as a multipart upload. Part 2 always fails and so does s3fs's abort of the
    # upload: the upload stays open (billed) until retention sweeps it.
    big = os.urandom(1 << 20) * 101
    faults = [
        Fault("error", method="PUT", path="partNumber=2", status=500),
        Fault("error", method="DELETE", path="uploadId=", status=500),
    ]
    with proxied(s3, faults) as (proxy, options):
        st = open_storage(s3.url, options, retries=0)
        with pytest.raises(StorageError, match="big.safetensors"):
            st.put_bytes("step_00000001/big.safetensors", big)
        assert proxy.count("error 500", "DELETE") >= 1
    assert "step_00000001/big.safetensors" not in keys(s3)
    assert open_uploads(s3) == [f"{s3.prefix}/step_00000001/big.safetensors"]
    # a later committed save runs retention, which aborts uploads left open under the root
    mgr = ckpt.CheckpointManager(s3.url, storage_options=s3.storage_options, async_save=False, keep_last=1)
    mgr.save(2, model=model())
    assert open_uploads(s3) == []


def test_multipart_part_reset_once_then_succeeds(s3: Any) -> None:
    big = os.urandom(1 << 20) * 101
    faults = [Fault("reset", method="PUT", path="partNumber=2", nth={1})]
    with proxied(s3, faults) as (proxy, options):
        open_storage(s3.url, options).put_bytes("blob.bin", big)
        assert proxy.count("reset") == 1
    assert s3.boto3_client().get_object(Bucket=s3.bucket, Key=f"{s3.prefix}/blob.bin")["Body"].read() == big
    assert open_uploads(s3) == []


def test_loads_retry_failed_and_slow_reads(s3: Any) -> None:
    m = model()
    ckpt.save(f"{s3.url}/step_00000001", step=1, model=m, storage_options=s3.storage_options)
    faults = [
        Fault("error", method="GET", path=".safetensors", nth={1, 2, 3}, status=500),
        Fault("delay", method="GET", seconds=0.2, fraction=0.3),
    ]
    with proxied(s3, faults) as (proxy, options):
        back = model()
        for p in back.parameters():
            torch.nn.init.zeros_(p)
        ckpt.restore(f"{s3.url}/step_00000001", model=back, storage_options=options)
        assert same(m, back)
        assert proxy.count("error 500", "GET") == 3


def test_load_that_keeps_failing_names_the_file(s3: Any) -> None:
    ckpt.save(f"{s3.url}/step_00000001", step=1, model=model(), storage_options=s3.storage_options)
    with proxied(s3, [Fault("error", method="GET", path=".safetensors", status=500)]) as (_, options):
        with pytest.raises(
            CkptError, match=r"step_00000001/r00000-\w+\.safetensors: tensor '0\.weight'"
        ) as info:
            ckpt.restore(f"{s3.url}/step_00000001", model=model(), storage_options=options)
        assert "\n" not in str(info.value)


def test_random_slowdowns_with_default_botocore_retries(s3: Any) -> None:
    # the configuration users run: botocore, s3fs and ckpt retry layers together, a fifth of requests throttled
    faults = [Fault("error", status=503, fraction=0.2, limit=12), Fault("delay", seconds=0.05, fraction=0.2)]
    with proxied(s3, faults, botocore_retries=True) as (proxy, options):
        m = model()
        mgr = ckpt.CheckpointManager(s3.url, storage_options=options, async_save=True, keep_last=1)
        for step in (1, 2, 3):
            mgr.save(step, model=m)
        mgr.wait()
        back = model()
        assert mgr.restore_latest(model=back) == 3
        assert same(m, back)
        mgr.close()
        assert proxy.count("error 503") > 0
    assert [i.step for i in list_checkpoints(s3.url, storage_options=s3.storage_options)] == [3]
