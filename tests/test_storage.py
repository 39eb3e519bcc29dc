"""The storage contract, run against every backend: local paths, ``file://``, ``memory://`` and S3 (moto).

fsspec's ``tests/abstract`` pattern: :class:`StorageContract` and :class:`FolderContract` hold the tests, and each
backend is a small subclass that says where to write.  A new backend adds one subclass here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import REAL_S3_URL

import ckpt.storage.local
from ckpt.errors import CheckpointExistsError, StorageError
from ckpt.storage import Storage, open_storage
from ckpt.storage.folder import begin_folder
from ckpt.storage.fsspec import FsspecStorage
from ckpt.storage.local import LocalStorage
from ckpt.storage.s3 import S3Storage

DATA = bytes(range(256)) * 40  # 10 KiB, every byte value


class StorageContract:
    """What every :class:`Storage` must do. Subclasses provide the ``location`` fixture: (url, options)."""

    backend: type[Storage]
    same_bytes_pass_create_only = (
        False  # remote: an identical object may be our own write whose reply was lost
    )

    @pytest.fixture
    def st(self, location: tuple[str, dict[str, Any] | None]) -> Storage:
        st = open_storage(*location)
        assert type(st) is self.backend
        return st

    def test_put_and_read_bytes(self, st: Storage) -> None:
        st.put_bytes("a/b/c.bin", DATA)
        assert st.read_bytes("a/b/c.bin") == DATA
        assert st.size("a/b/c.bin") == len(DATA)
        st.put_bytes("empty", b"")
        assert st.read_bytes("empty") == b"" and st.size("empty") == 0
        with pytest.raises(FileNotFoundError):
            st.read_bytes("missing.bin")

    def test_create_publishes_only_on_clean_exit(self, st: Storage) -> None:
        with st.create("x.bin") as f:
            f.write(DATA[:100])
            f.write(memoryview(DATA)[100:])
            assert st.size("x.bin") is None  # nothing visible before the publish
        assert st.read_bytes("x.bin") == DATA

    def test_an_exception_inside_create_publishes_nothing(self, st: Storage) -> None:
        with pytest.raises(RuntimeError, match="boom"), st.create("d/x.bin") as f:
            f.write(DATA)
            raise RuntimeError("boom")
        assert not st.exists("d/x.bin") and st.listdir("d") == []  # no temp file left either
        st.put_bytes("d/y.bin", b"old")
        with pytest.raises(RuntimeError), st.create("d/y.bin", exclusive=False) as f:
            f.write(b"new")
            raise RuntimeError("boom")
        assert st.read_bytes("d/y.bin") == b"old" and st.listdir("d") == ["y.bin"]

    def test_create_only_refuses_an_existing_name(self, st: Storage) -> None:
        st.put_bytes("m.json", b"first")
        with pytest.raises(CheckpointExistsError, match="m.json already exists") as info:
            st.put_bytes("m.json", b"second")
        assert "\n" not in str(info.value) and st.display("m.json") in str(info.value)
        assert st.read_bytes("m.json") == b"first"
        st.put_bytes("m.json", b"third", exclusive=False)
        assert st.read_bytes("m.json") == b"third"

    def test_create_only_of_the_bytes_already_there(self, st: Storage) -> None:
        st.put_bytes("m.json", b"same")
        if self.same_bytes_pass_create_only:
            st.put_bytes("m.json", b"same")
        else:
            with pytest.raises(CheckpointExistsError):
                st.put_bytes("m.json", b"same")
        assert st.read_bytes("m.json") == b"same"

    def test_a_file_bigger_than_the_memory_spool(
        self, st: Storage, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
    ) -> None:
        monkeypatch.setattr(FsspecStorage, "spool_limit", 1000)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the spool's temp files go
        with st.create("big.bin") as f:
            for i in range(0, len(DATA), 300):
                f.write(DATA[i : i + 300])
        assert st.read_bytes("big.bin") == DATA
        with pytest.raises(CheckpointExistsError):
            st.put_bytes("big.bin", DATA[::-1])  # the content check reads the big existing file back
        with pytest.raises(RuntimeError), st.create("big2.bin") as f:
            f.write(DATA)
            raise RuntimeError("boom")
        assert not st.exists("big2.bin")
        assert [n for n in os.listdir(tmp_path) if n.startswith("ckpt-upload-")] == []

    def test_read_range_is_exact_or_an_error(self, st: Storage) -> None:
        st.put_bytes("r.bin", DATA)
        assert st.read_range("r.bin", 0, len(DATA)) == DATA
        assert st.read_range("r.bin", 1000, 3000) == DATA[1000:4000]
        assert st.read_range("r.bin", 5, 0) == b""
        for start in (len(DATA) - 2, len(DATA) + 10):  # truncated, and entirely past the end
            with pytest.raises(StorageError, match=r"r\.bin: short read at") as info:
                st.read_range("r.bin", start, 5)
            assert "\n" not in str(info.value)
        with pytest.raises(FileNotFoundError):
            st.read_range("missing.bin", 0, 4)

    def test_read_into_sees_every_byte_once(self, st: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(ckpt.storage.local, "READ_BLOCK", 1000)  # several blocks on local disk
        st.put_bytes("r.bin", DATA)
        out = bytearray(len(DATA) - 100)
        seen: list[bytes] = []
        st.read_into("r.bin", 100, memoryview(out), lambda block: seen.append(bytes(block)))
        assert bytes(out) == DATA[100:]
        assert b"".join(seen) == DATA[100:]
        if isinstance(st, LocalStorage):
            assert [len(b) for b in seen] == [1000] * 10 + [140]
        with pytest.raises(StorageError, match="short read"):
            st.read_into("r.bin", len(DATA) - 10, memoryview(bytearray(20)))

    def test_size_exists_is_dir_listdir(self, st: Storage) -> None:
        for rel in ("d/b", "d/a", "d/sub/c", "top"):
            st.put_bytes(rel, b"x")
        assert st.listdir() == ["d", "top"]
        assert st.listdir("d") == ["a", "b", "sub"]
        assert st.listdir("missing") == [] and st.listdir("d/a") == []
        assert st.is_dir() and st.is_dir("d") and st.is_dir("d/sub")
        assert not st.is_dir("d/a") and not st.is_dir("missing")
        assert st.exists("d") and st.exists("d/a") and not st.exists("d/zz")
        assert st.size("d/a") == 1 and st.size("d/zz") is None and st.size("d") is None

    def test_delete_and_delete_tree(self, st: Storage) -> None:
        for rel in ("t/a", "t/s/b", "t2/c", "tx"):
            st.put_bytes(rel, b"x")
        st.delete("t/a")
        st.delete("t/a")  # idempotent
        assert not st.exists("t/a") and st.exists("t/s/b")
        st.delete_tree("t")
        st.delete_tree("t")
        st.delete_tree("missing")
        assert st.listdir() == ["t2", "tx"]  # siblings sharing the name as a prefix are untouched
        st.delete_tree("tx")  # a file
        assert st.listdir() == ["t2"]

    def test_child_and_display(self, st: Storage, location: tuple[str, dict[str, Any] | None]) -> None:
        sub = st.child("run/step_1")
        assert type(sub) is type(st)
        sub.put_bytes("f.bin", b"1")
        assert st.read_bytes("run/step_1/f.bin") == b"1" and sub.listdir() == ["f.bin"]
        assert sub.display("f.bin") == st.display("run/step_1/f.bin")
        assert st.display("a/b").endswith("/a/b") and st.display() in st.display("a/b")
        assert open_storage(sub.url, location[1]).read_bytes("f.bin") == b"1"

    def test_local_path(self, st: Storage) -> None:
        st.put_bytes("f.bin", b"abc")
        path = st.local_path("f.bin")
        if isinstance(st, LocalStorage):
            with open(path or "", "rb") as f:
                assert f.read() == b"abc"
        else:
            assert path is None

    def test_no_stale_uploads_after_clean_writes(self, st: Storage) -> None:
        st.put_bytes("a", b"x")
        assert st.abort_stale_uploads() == 0


class FolderContract:
    """The folder transaction on every backend; ``location`` as in :class:`StorageContract`."""

    worker_in_subprocess = True  # memory:// lives in one process

    @pytest.fixture
    def dst(self, location: tuple[str, dict[str, Any] | None]) -> tuple[str, dict[str, Any] | None]:
        url, options = location
        return f"{url}/out", options

    def test_commit_publishes_files_then_markers(self, dst: tuple[str, Any]) -> None:
        url, options = dst
        txn = begin_folder(url, options)
        txn.storage.put_bytes("a.bin", DATA)
        txn.storage.put_bytes("sub/b.bin", b"b")
        final = open_storage(url, options)
        assert not final.exists("done")
        txn.commit({"done": b"ok", "sub/meta": b"m"})
        assert final.read_bytes("a.bin") == DATA and final.read_bytes("sub/b.bin") == b"b"
        assert final.read_bytes("done") == b"ok" and final.read_bytes("sub/meta") == b"m"
        assert final.listdir() == ["a.bin", "done", "sub"]
        parent = open_storage(url.rsplit("/", 1)[0], options)
        assert parent.listdir() == ["out"]  # no temp folder left beside it
        txn.abort()  # after a commit: nothing happens
        assert final.read_bytes("done") == b"ok"
        with pytest.raises(StorageError, match="already committed"):
            txn.commit()

    def test_abort_leaves_nothing(self, dst: tuple[str, Any]) -> None:
        url, options = dst
        txn = begin_folder(url, options)
        txn.storage.put_bytes("a.bin", DATA)
        txn.storage.put_bytes("sub/b.bin", b"b")
        txn.abort()
        txn.abort()
        assert open_storage(url.rsplit("/", 1)[0], options).listdir() == []
        with begin_folder(url, options) as txn2, pytest.raises(RuntimeError):  # an error in the block: abort
            txn2.storage.put_bytes("a.bin", b"x")
            raise RuntimeError("boom")
        with begin_folder(url, options) as txn3:  # no commit in the block: abort
            txn3.storage.put_bytes("a.bin", b"x")
        assert open_storage(url.rsplit("/", 1)[0], options).listdir() == []

    def test_a_used_destination_is_refused(self, dst: tuple[str, Any]) -> None:
        url, options = dst
        open_storage(url, options).put_bytes("old.bin", b"x")
        with pytest.raises(
            CheckpointExistsError, match=r"out: already exists \(a non-empty folder\)"
        ) as info:
            begin_folder(url, options)
        assert "\n" not in str(info.value)
        open_storage(url.rsplit("/", 1)[0], options).put_bytes("file", b"x")
        with pytest.raises(CheckpointExistsError, match=r"file: already exists \(a file\)"):
            begin_folder(url.rsplit("/", 1)[0] + "/file", options)
        assert open_storage(url, options).listdir() == ["old.bin"]

    def test_a_marker_a_worker_wrote_is_refused(self, dst: tuple[str, Any]) -> None:
        url, options = dst
        txn = begin_folder(url, options)
        open_storage(txn.url, txn.storage_options).put_bytes("done", b"early")
        with pytest.raises(CheckpointExistsError, match="done already exists"):
            txn.commit({"done": b"ok"})
        txn.abort()
        assert open_storage(url, options).listdir() == []

    def test_workers_write_through_the_url(self, dst: tuple[str, Any]) -> None:
        url, options = dst
        txn = begin_folder(url, options)
        open_storage(txn.url, txn.storage_options).put_bytes("rank0.bin", b"0")
        if self.worker_in_subprocess:  # a real second process, given only the URL and the options
            code = (
                "import sys, json; from ckpt.storage import open_storage; "
                "open_storage(sys.argv[1], json.loads(sys.argv[2])).put_bytes('rank1.bin', b'1')"
            )
            subprocess.run([sys.executable, "-c", code, txn.url, json.dumps(options)], check=True)
        txn.commit({"done": b""})
        published = open_storage(url, options)
        expected = ["done", "rank0.bin"] + (["rank1.bin"] if self.worker_in_subprocess else [])
        assert published.listdir() == expected
        assert published.read_bytes("rank0.bin") == b"0"


# ------------------------------------------------------------------------------------------------ backends


class TestLocal(StorageContract, FolderContract):
    backend = LocalStorage

    @pytest.fixture
    def location(self, tmp_path: Any) -> tuple[str, None]:
        return str(tmp_path / "root"), None

    def test_folder_is_built_hidden_beside_the_destination(self, tmp_path: Any) -> None:
        dst = tmp_path / "hf"
        dst.mkdir()  # an existing empty destination folder is allowed
        txn = begin_folder(str(dst))
        assert os.path.dirname(txn.url) == str(tmp_path) and os.path.basename(txn.url).startswith(".hf.tmp-")
        with open(os.path.join(txn.url, "w.bin"), "wb") as f:  # any writer, e.g. torch.save to a path
            f.write(b"w")
        assert os.listdir(dst) == []
        txn.commit({"done": b""})
        assert sorted(os.listdir(dst)) == ["done", "w.bin"] and not os.path.exists(txn.url)


class TestFileUrl(TestLocal):
    worker_in_subprocess = False  # TestLocal runs it

    @pytest.fixture
    def location(self, tmp_path: Any) -> tuple[str, None]:
        return f"file://{tmp_path}/root", None


class TestMemory(StorageContract, FolderContract):
    backend = FsspecStorage
    same_bytes_pass_create_only = True
    worker_in_subprocess = False

    @pytest.fixture
    def location(self) -> Iterator[tuple[str, None]]:
        import fsspec

        name = f"ckpt-test-{uuid.uuid4().hex[:10]}"
        yield f"memory://{name}", None
        with contextlib.suppress(FileNotFoundError):
            fsspec.filesystem("memory").rm(f"/{name}", recursive=True)


@pytest.mark.s3
class TestS3(StorageContract, FolderContract):
    backend = S3Storage
    same_bytes_pass_create_only = True

    @pytest.fixture
    def location(self, s3: Any) -> tuple[str, dict[str, Any]]:
        return f"{s3.url}/st", s3.storage_options

    def test_multipart_upload(self, location: tuple[str, dict[str, Any]], s3: Any) -> None:
        # a file larger than one part is a multipart upload from memory (parts of part_size; moto takes small ones)
        st = open_storage(*location)
        assert isinstance(st, S3Storage)
        st.part_size = 8 << 20
        block = os.urandom(1 << 20)
        with st.create("big.bin") as f:
            for _ in range(21):
                f.write(block)
        head = s3.boto3_client().head_object(Bucket=s3.bucket, Key=f"{s3.prefix}/st/big.bin")
        assert head["ETag"].strip('"').endswith("-3")  # three parts: 8 + 8 + 5 MiB
        assert st.size("big.bin") == 21 << 20
        assert st.read_range("big.bin", (20 << 20) - 7, 1 << 20) == block[-7:] + block[: (1 << 20) - 7]
        digest = hashlib.sha256(st.read_bytes("big.bin")).hexdigest()
        assert digest == hashlib.sha256(block * 21).hexdigest()
        assert st.open_uploads() == []

    def test_abort_stale_uploads(self, location: tuple[str, dict[str, Any]], s3: Any) -> None:
        client = s3.boto3_client()
        for key in ("st/step_1/a", "st/step_2/b", "elsewhere/c"):
            client.create_multipart_upload(Bucket=s3.bucket, Key=f"{s3.prefix}/{key}")
        st = open_storage(*location)
        assert isinstance(st, S3Storage)
        assert sorted(k for k, _ in st.open_uploads()) == [
            f"{s3.prefix}/st/step_1/a",
            f"{s3.prefix}/st/step_2/b",
        ]
        assert st.abort_stale_uploads("step_1") == 1
        assert st.abort_stale_uploads() == 1
        assert st.open_uploads() == []
        remaining = client.list_multipart_uploads(Bucket=s3.bucket)["Uploads"]
        assert [u["Key"] for u in remaining] == [f"{s3.prefix}/elsewhere/c"]

    @pytest.mark.skipif(
        bool(REAL_S3_URL), reason="the fault proxy speaks plain HTTP to a loopback moto server"
    )
    def test_a_failed_create_only_write_is_not_reported_as_existing(self, s3: Any) -> None:
        # A 500 that outlasts the retries on a create-only PUT whose key contains "412": it used to be read as
        # "412 PreconditionFailed" from the message text and reported as "already exists".
        from torture.faultproxy import Fault, fault_proxy

        with fault_proxy(s3.endpoint, [Fault("error", method="PUT", status=500)]) as proxy:
            options = {
                "client_kwargs": {"endpoint_url": proxy.url},
                "config_kwargs": {"retries": {"max_attempts": 1}},
            }
            st = open_storage(s3.url, options, retries=0)
            with pytest.raises(StorageError, match=r"writing .*step_00000412/manifest\.json failed"):
                st.put_bytes("step_00000412/manifest.json", b"{}")
            assert proxy.count("error 500", "PUT") >= 1
