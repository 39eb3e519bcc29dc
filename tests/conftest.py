"""Shared fixtures for the core tests: an S3 endpoint (moto, or a real one) and real multi-process gloo runs.

S3: a session-scoped moto ``ThreadedMotoServer`` on 127.0.0.1 (random port), wiped before every test.  Set
``CKPT_TEST_S3_URL=s3://bucket/prefix`` (plus the usual AWS credentials and, for a non-AWS endpoint,
``CKPT_TEST_S3_ENDPOINT``) to run the same tests against a real endpoint instead; each test then gets its own
unique prefix, removed afterwards.

Multi-process: :func:`run_ranks` runs a module-level function in N fresh spawned processes, each with a gloo
process group on 127.0.0.1, and turns any child's exception into a test failure carrying its traceback.
"""

from __future__ import annotations

import os

# moto reads this when it is imported: allow tiny multipart parts so that multipart logic runs on small files.
os.environ.setdefault("S3_UPLOAD_PART_MIN_SIZE", "1024")

import contextlib  # noqa: E402
import multiprocessing as mp  # noqa: E402
import queue  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import urllib.request  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

REAL_S3_URL = os.environ.get("CKPT_TEST_S3_URL")
BUCKET = "ckpt-test"


@dataclass(frozen=True)
class S3Target:
    """Where a test may write: ``url`` (``s3://bucket/prefix``) and the fsspec options to reach it."""

    url: str
    storage_options: dict[str, Any]
    endpoint: str | None
    bucket: str
    prefix: str

    def boto3_client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def fs(self) -> Any:
        import fsspec

        return fsspec.filesystem("s3", **self.storage_options)


@pytest.fixture(scope="session")
def _s3_endpoint() -> Iterator[tuple[str | None, dict[str, Any]]]:
    if REAL_S3_URL:
        endpoint = os.environ.get("CKPT_TEST_S3_ENDPOINT")
        yield endpoint, ({"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {})
        return
    from torture.s3 import moto_server

    with moto_server(bucket=None) as url:
        yield url, {"client_kwargs": {"endpoint_url": url}}


@pytest.fixture
def s3(_s3_endpoint: tuple[str | None, dict[str, Any]]) -> Iterator[S3Target]:
    """A clean S3 location for one test (moto state wiped first, or a fresh prefix on a real endpoint)."""
    import fsspec

    endpoint, options = _s3_endpoint
    if REAL_S3_URL:
        base = REAL_S3_URL.removeprefix("s3://").rstrip("/")
        bucket, _, root = base.partition("/")
        prefix = f"{root}/ckpt-test-{uuid.uuid4().hex[:10]}".lstrip("/")
    else:
        req = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
        bucket, prefix = BUCKET, "run"
    fs = fsspec.filesystem("s3", **options)
    fs.invalidate_cache()  # fsspec caches the instance: drop listings from the previous test
    target = S3Target(f"s3://{bucket}/{prefix}", options, endpoint, bucket, prefix)
    if not REAL_S3_URL:
        target.boto3_client().create_bucket(Bucket=bucket)
    try:
        yield target
    finally:
        fs.invalidate_cache()
        if REAL_S3_URL:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(f"{bucket}/{prefix}", recursive=True)


# -------------------------------------------------------------------------------------------- multi-process


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int | None,
    args: tuple[Any, ...],
    results: Any,
) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        if port is not None:
            import torch.distributed as dist

            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(world),
                GLOO_SOCKET_IFNAME="lo",
            )
            dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            value = fn(rank, world, *args)
        finally:
            if port is not None:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - sent to the parent, which fails the test with it
        results.put((rank, False, traceback.format_exc()))


def _late_failures(results: Any, left: int, grace: float = 5.0) -> list[str]:
    """Errors the other ranks report within ``grace`` seconds of the first (the root cause is often among them)."""
    late: list[str] = []
    deadline = time.monotonic() + grace
    for _ in range(left):
        try:
            rank, ok, value = results.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if not ok:
            late.append(f"--- rank {rank} raised:\n{value}")
    return late


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    process_group: bool = True,
    timeout: float = 180.0,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes; return the values in rank order.

    ``fn`` must be a module-level function (it is pickled by reference).  With ``process_group`` each child
    joins a gloo group (MASTER_ADDR=127.0.0.1, a free port).  A child's exception fails the calling test with
    that child's traceback; a hung child fails it after ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port() if process_group else None
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, port, args, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                dead = [f"rank {r} exit code {p.exitcode}" for r, p in enumerate(procs) if not p.is_alive()]
                failures.append(
                    f"timed out after {timeout}s waiting for ranks ({', '.join(dead) or 'all alive'})"
                )
                break
            if ok:
                out[rank] = value
            else:
                failures.append(f"--- rank {rank} raised:\n{value}")
                if process_group:
                    # the others are probably stuck in a collective with the failed rank; the first to report
                    # may only have seen a peer vanish, so the others' own errors get a few seconds to arrive
                    failures += _late_failures(results, world - len(out) - 1)
                    break
    finally:
        for p in procs:
            p.join(timeout=10 if not failures else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    return [out[r] for r in range(world)]


# -------------------------------------------------------------------------------------------- NxD source


@pytest.fixture(scope="session")
def nxd_src(tmp_path_factory: pytest.TempPathFactory) -> str:
    """NxD 2.29's source (``src/`` of the vendored archive, sha256-checked), extracted once per session; the tests that
    run NxD's own code skip, saying why, when the archive is absent."""
    from nxd_vendor import ARCHIVE, extract

    if not ARCHIVE.is_file():
        pytest.skip(f"NxD source archive {ARCHIVE} is absent (see tests/vendor/README.md to rebuild it)")
    return str(extract(tmp_path_factory.mktemp("nxd_src")))


@pytest.fixture
def shm_dir() -> Iterator[Any]:
    """A fresh folder in host memory (/dev/shm: the memory tier's home), removed afterwards."""
    import shutil
    import tempfile
    from pathlib import Path

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    d = Path(tempfile.mkdtemp(prefix="ckpt-test-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
