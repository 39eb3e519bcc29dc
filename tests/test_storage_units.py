"""Storage pieces with a contract of their own: error classification, the retry loop, the backend registry."""

from __future__ import annotations

import ast
import errno
import importlib
import importlib.util
import pathlib
from collections.abc import Callable

import pytest
from botocore.exceptions import ClientError

import ckpt.storage
from ckpt.errors import CheckpointExistsError, StorageError
from ckpt.storage import BACKENDS, FSSPEC, Storage, open_storage, scheme
from ckpt.storage.fsspec import FsspecStorage
from ckpt.storage.local import LocalStorage
from ckpt.storage.retry import transient, with_retries
from ckpt.storage.s3 import S3Storage, precondition_failed


def client_error(code: str, status: int) -> ClientError:
    """The exception botocore raises for an S3 error response."""
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
    )


def chained(outer: BaseException, cause: BaseException) -> BaseException:
    """``outer`` raised ``from cause``, as s3fs chains the botocore error under the OSError it raises."""
    try:
        raise outer from cause
    except BaseException as e:  # noqa: BLE001
        return e


# ---------------------------------------------------------------------------------------------- classification


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionResetError("peer"),
        TimeoutError("slow"),
        OSError(errno.EREMOTEIO, "We encountered an internal error. Please try again."),  # s3fs's 500
        OSError(errno.EBUSY, "Please reduce your request rate."),  # s3fs's SlowDown
        client_error("SlowDown", 503),
        client_error("RequestTimeout", 400),
        client_error("WhateverTheStoreSays", 502),
        chained(OSError(errno.EIO, "opaque"), client_error("InternalError", 500)),
        RuntimeError("EndpointConnectionError: Could not connect"),
    ],
)
def test_transient_errors_are_retried(exc: BaseException) -> None:
    assert transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError("k"),
        FileExistsError("k"),
        PermissionError("denied"),
        IsADirectoryError("d"),
        ValueError("bad argument"),
        client_error("AccessDenied", 403),
        client_error("PreconditionFailed", 412),
        chained(
            OSError(errno.EINVAL, "At least one of the pre-conditions did not hold"), client_error("X", 412)
        ),
    ],
)
def test_permanent_errors_are_not_retried(exc: BaseException) -> None:
    assert not transient(exc)


def test_precondition_failed_is_read_from_the_error_not_from_the_key() -> None:
    assert precondition_failed(client_error("PreconditionFailed", 412))
    wrapped = chained(OSError(errno.EINVAL, "pre-conditions"), client_error("PreconditionFailed", 412))
    assert precondition_failed(chained(StorageError("writing s3://b/x failed"), wrapped))
    assert precondition_failed(client_error("Whatever", 412))
    server_error = chained(OSError(errno.EREMOTEIO, "internal error"), client_error("InternalError", 500))
    named_412 = chained(StorageError("writing s3://b/step_00000412/manifest.json failed: 500"), server_error)
    assert not precondition_failed(named_412)


# ---------------------------------------------------------------------------------------------- retry loop


def flaky(failures: list[BaseException], result: str = "ok") -> tuple[list[int], Callable[[], str]]:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return result

    return calls, fn


def test_transient_failures_are_retried_until_success() -> None:
    calls, fn = flaky([ConnectionResetError("a"), client_error("SlowDown", 503)])
    refreshed: list[int] = []
    assert (
        with_retries("reading", "s3://b/k", fn, retries=2, before_retry=lambda: refreshed.append(1)) == "ok"
    )
    assert len(calls) == 3 and len(refreshed) == 2


def test_retries_run_out_into_one_storage_error_line() -> None:
    calls, fn = flaky([ConnectionResetError("gone")] * 5)
    with pytest.raises(StorageError, match=r"^reading s3://b/k failed: ConnectionResetError: gone$"):
        with_retries("reading", "s3://b/k", fn, retries=2)
    assert len(calls) == 3


def test_permanent_failures_are_not_retried() -> None:
    calls, fn = flaky([ValueError("bad")])
    with pytest.raises(StorageError, match="writing s3://b/k failed: ValueError: bad"):
        with_retries("writing", "s3://b/k", fn, retries=5)
    assert len(calls) == 1
    for passthrough in (FileNotFoundError("k"), FileExistsError("k"), CheckpointExistsError("k")):
        calls, fn = flaky([passthrough])
        with pytest.raises(type(passthrough)):
            with_retries("writing", "s3://b/k", fn, retries=5)
        assert len(calls) == 1
    calls, fn = flaky([OSError(errno.ENOENT, "No such key")])  # what s3fs raises for a missing key
    with pytest.raises(FileNotFoundError):
        with_retries("reading", "s3://b/k", fn, retries=5)
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------- registry


@pytest.mark.parametrize(
    ("url", "name"),
    [("/data/run", "file"), ("rel/run", "file"), ("file:///data", "file"), ("S3://b/k", "s3"),
     ("memory://x", "memory"), ("simplecache::s3://b/k", "simplecache")],
)  # fmt: skip
def test_scheme(url: str, name: str) -> None:
    assert scheme(url) == name


def test_open_storage_dispatches_by_scheme(tmp_path: pathlib.Path) -> None:
    assert type(open_storage(tmp_path)) is LocalStorage  # a Path too
    assert type(open_storage(f"file://{tmp_path}")) is LocalStorage
    assert open_storage(f"file://{tmp_path}").local_path() == str(tmp_path)
    assert type(open_storage("memory://ckpt-unit")) is FsspecStorage
    for url in ("s3://bucket/run", "s3a://bucket/run"):
        st = open_storage(url, {"anon": True}, retries=2)  # no request is made
        assert type(st) is S3Storage and st.retries == 2 and st.display("x") == f"{url}/x"


def test_every_registered_backend_is_a_storage() -> None:
    for backend in [*BACKENDS.values(), FSSPEC]:
        module, _, name = backend.target.partition(":")
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, Storage) and not getattr(cls, "__abstractmethods__", None), backend
    with pytest.raises(TypeError):
        Storage()  # type: ignore[abstract]


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_a_scheme_whose_implementation_is_missing_says_what_to_install() -> None:
    with pytest.raises(StorageError) as info:
        open_storage("gs://bucket/run")
    msg = str(info.value)
    assert msg == (
        "gs://bucket/run: the gs:// scheme needs the package 'gcsfs', which is not installed (pip install gcsfs)"
    )
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_an_unknown_scheme_is_one_line() -> None:
    with pytest.raises(StorageError, match=r"^nope://x/y: unknown storage scheme 'nope' \(expected") as info:
        open_storage("nope://x/y")
    assert "\n" not in str(info.value)


def test_the_storage_package_does_not_import_torch() -> None:
    # the CLI imports storage to list checkpoints; torch costs seconds (only ckpt's other modules may need it)
    for path in pathlib.Path(ckpt.storage.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not [n for n in names if n.split(".")[0] in ("torch", "numpy")], (path.name, names)
