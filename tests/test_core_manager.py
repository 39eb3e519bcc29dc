"""CheckpointManager on local disk and on S3 (moto, or CKPT_TEST_S3_URL): retention, discovery, fallback."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
from ckpt.format.manifest import MANIFEST_NAME
from ckpt.restoring.discovery import step_dir
from ckpt.storage import Storage, open_storage

pytestmark = pytest.mark.timeout(120)


@dataclass
class Root:
    url: str
    storage_options: dict[str, Any] | None
    s3: Any = None

    def storage(self) -> Storage:
        return open_storage(self.url, self.storage_options)

    def manager(self, **kw: Any) -> ckpt.CheckpointManager:
        kw.setdefault("async_save", False)
        return ckpt.CheckpointManager(self.url, storage_options=self.storage_options, **kw)

    def steps_on_storage(self) -> list[str]:
        return [n for n in self.storage().listdir() if n.startswith("step_")]


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Root:
    if request.param == "local":
        return Root(str(tmp_path / "run"), None)
    s3 = request.getfixturevalue("s3")
    return Root(s3.url, s3.storage_options, s3)


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 4), value), "b": torch.arange(5) + int(value)}


def data_file(root: Root, step: int) -> str:
    man = ckpt.open_checkpoint(f"{root.url}/{step_dir(step)}", root.storage_options).manifest
    (name,) = man.files
    return f"{step_dir(step)}/{name}"


# ------------------------------------------------------------------------------------------------ retention


def test_keep_last(root: Root) -> None:
    mgr = root.manager(keep_last=2)
    for step in range(1, 6):
        mgr.save(step, model=state(step)).result()
    assert root.steps_on_storage() == [step_dir(4), step_dir(5)]
    assert [i.step for i in mgr.list()] == [4, 5]
    assert mgr.latest_step() == 5


def test_keep_every_with_keep_last(root: Root) -> None:
    mgr = root.manager(keep_last=1, keep_every=2)
    for step in range(1, 6):
        mgr.save(step, model=state(step)).result()
    assert [i.step for i in mgr.list()] == [2, 4, 5]


def test_retention_deletes_the_manifest_before_the_data(root: Root, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = root.manager(keep_last=1)
    mgr.save(1, model=state(1)).result()
    # a crash while deleting the data of step 1: the checkpoint must already be uncommitted
    monkeypatch.setattr(
        type(mgr.storage), "delete_tree", lambda self, rel: (_ for _ in ()).throw(OSError("crash"))
    )
    with pytest.warns(UserWarning, match="crash"):
        mgr.save(2, model=state(2)).result()
    infos = {i.step: i.status for i in mgr.list()}
    assert infos == {1: "uncommitted", 2: "committed"}
    monkeypatch.undo()
    mgr.save(3, model=state(3)).result()  # the next retention pass sweeps the leftover
    assert root.steps_on_storage() == [step_dir(3)]


def test_uncommitted_leftovers_are_swept(root: Root) -> None:
    st = root.storage()
    st.put_bytes(f"{step_dir(3)}/r00000-dead.safetensors", b"partial")  # a crashed save, no manifest
    mgr = root.manager(keep_last=5)
    mgr.save(2, model=state(2)).result()
    assert step_dir(3) in root.steps_on_storage()  # newer than the newest commit: maybe still in flight
    st.put_bytes(f"{step_dir(4)}/junk", b"leftover of a failed attempt at step 4")
    mgr.save(4, model=state(4), overwrite=True).result()
    assert root.steps_on_storage() == [step_dir(2), step_dir(4)]
    assert "junk" not in st.child(step_dir(4)).listdir()
    top = json.loads(st.child(step_dir(4)).read_bytes(MANIFEST_NAME))
    # format v2: the top manifest lists each rank's index and state file
    indexes = [*top.get("indexes", {}), *top.get("rank_state", {})]
    want = [MANIFEST_NAME, data_file(root, 4).split("/")[1], *indexes]
    assert st.child(step_dir(4)).listdir() == sorted(want)


# ------------------------------------------------------------------------------------------------ restoring


def test_restore_latest_on_an_empty_root_returns_none(root: Root) -> None:
    live = state(0)
    assert root.manager().restore_latest(model=live) is None
    assert torch.equal(live["w"], torch.zeros(3, 4))


def test_discovery_orders_by_step_not_by_mtime(root: Root) -> None:
    mgr = root.manager()
    for step in (100, 99, 9):  # written newest-step first: the oldest *step* has the newest mtime
        mgr.save(step, model=state(step)).result()
    if root.s3 is None:
        os.utime(Path(root.url) / step_dir(100), (1, 1))
    infos = ckpt.list_checkpoints(root.url, storage_options=root.storage_options)
    assert [i.step for i in infos] == [9, 99, 100]
    live = state(0)
    assert mgr.restore_latest(model=live) == 100
    assert torch.equal(live["w"], state(100)["w"])


def flip_byte(root: Root, rel: str) -> None:
    st = root.storage()
    raw = bytearray(st.read_bytes(rel))
    raw[-3] ^= 0x10  # inside the last tensor's data
    st.put_bytes(rel, bytes(raw), exclusive=False)


@pytest.mark.parametrize("damage", ["corrupt", "missing", "truncated"])
def test_restore_latest_falls_back_from_a_damaged_newest_checkpoint(root: Root, damage: str) -> None:
    mgr = root.manager()
    mgr.save(1, model=state(1)).result()
    mgr.save(2, model=state(2)).result()
    rel = data_file(root, 2)
    if damage == "corrupt":
        flip_byte(root, rel)
    elif damage == "missing":
        root.storage().delete(rel)
    else:
        st = root.storage()
        st.put_bytes(rel, st.read_bytes(rel)[:-4], exclusive=False)
    live = state(0)
    with pytest.warns(UserWarning, match=r"step 2.*(checksum|missing|bytes)"):
        assert mgr.restore_latest(model=live) == 1
    assert torch.equal(live["w"], state(1)["w"]) and torch.equal(live["b"], state(1)["b"])


def test_restore_latest_says_it_skips_a_newer_step_without_a_manifest(root: Root) -> None:
    """A newer folder without a manifest (interrupted save, or a deleted manifest) is skipped with a warning naming
    the step; older leftovers below the restored step are not worth a warning."""
    mgr = root.manager()
    mgr.save(1, model=state(1)).result()
    mgr.save(2, model=state(2)).result()
    mgr.save(3, model=state(3)).result()
    st = root.storage()
    st.child(step_dir(3)).delete(MANIFEST_NAME)  # a deleted manifest
    leftover = "r00000-deadbeef.safetensors"
    st.put_bytes(f"{step_dir(4)}/{leftover}", b"partial", exclusive=False)  # an interrupted save
    st.put_bytes(f"{step_dir(0)}/{leftover}", b"partial", exclusive=False)  # an older leftover
    live = state(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.restore_latest(model=live) == 2
    messages = [str(w.message) for w in caught]
    for step in (3, 4):
        assert any(f"skipping step {step}:" in m and "no manifest.json" in m for m in messages), messages
    assert not any("step 0" in m for m in messages), messages
    assert torch.equal(live["w"], state(2)["w"])


def test_restore_latest_with_only_damaged_checkpoints_returns_none(root: Root) -> None:
    mgr = root.manager()
    mgr.save(1, model=state(1)).result()
    root.storage().delete(data_file(root, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.restore_latest(model=state(0)) is None
    assert any("step 1" in str(w.message) for w in caught)


def _no_fallback(mgr: ckpt.CheckpointManager, **live: Any) -> str:
    """restore_latest must raise StateMismatchError without warning about (or trying) older steps."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ckpt.StateMismatchError) as info:
            mgr.restore_latest(**live)
    assert not [w for w in caught if "falling back" in str(w.message)], [str(w.message) for w in caught]
    assert "step 2" in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("live", ["shape", "empty_model", "missing_layer", "no_optimizer_saved"])
def test_restore_latest_raises_at_once_when_the_caller_does_not_fit(root: Root, live: str) -> None:
    """The README loop ``start = (mgr.restore_latest(...) or 0) + 1`` must not restart at step 1 because the model
    changed: a mismatch is the caller's, not the checkpoint's, and older steps would not fit either."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    mgr = root.manager()
    mgr.save(1, model=model).result()
    mgr.save(2, model=model).result()
    if live == "shape":
        msg = _no_fallback(mgr, model=torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)))
        assert "shape" in msg
    elif live == "empty_model":
        msg = _no_fallback(mgr, model={})
        assert "not in the model" in msg
    elif live == "missing_layer":
        msg = _no_fallback(mgr, model=torch.nn.Sequential(torch.nn.Linear(4, 3)))
        assert "not in the model" in msg and "1.weight" in msg
    else:
        msg = _no_fallback(mgr, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        assert "no optimizer state" in msg
    assert root.steps_on_storage() == [step_dir(1), step_dir(2)]  # nothing deleted, nothing written


def test_retention_never_deletes_the_writing_runs_checkpoints(root: Root) -> None:
    """An old run left steps 4 and 5; a new run writing steps 1, 2, 3 with keep_last=2 keeps its own newest two
    (the old, higher steps are another timeline: neither deleted nor counted as newest)."""
    old = root.manager(keep_last=2)
    for step in (4, 5):
        old.save(step, model=state(step)).result()
    new = root.manager(keep_last=2)
    for step in (1, 2, 3):
        new.save(step, model=state(10 + step)).result()
        assert step_dir(step) in root.steps_on_storage()
    assert root.steps_on_storage() == [step_dir(s) for s in (2, 3, 4, 5)]
    got = state(0)
    new.restore(3, model=got)
    assert torch.equal(got["w"], state(13)["w"])


def test_full_training_state_round_trips_through_the_manager(root: Root) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    mgr = root.manager(async_save=True, codec="zstd")
    mgr.save(1, model=model, optimizer=opt, scheduler=sched, progress={"tokens": 12})
    mgr.close()
    torch.manual_seed(1)
    m2 = torch.nn.Linear(4, 2)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1, gamma=0.5)
    assert mgr.restore_latest(model=m2, optimizer=opt2, scheduler=sched2) == 1
    assert torch.equal(m2.weight, model.weight) and torch.equal(m2.bias, model.bias)
    assert sched2.state_dict() == sched.state_dict() and opt2.param_groups[0]["lr"] == 0.05
    for p, q in zip(model.parameters(), m2.parameters(), strict=True):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], opt2.state[q][k])
    res = mgr.restore(1, model=m2)
    assert res.progress == {"step": 1, "tokens": 12}


# ------------------------------------------------------------------------------------------------ S3 only


def test_multipart_data_file_round_trips_on_s3(s3: Any) -> None:
    # > 2 x 50 MiB: s3fs put_file uploads it as a multipart upload (and the staging spools to a local file)
    w = torch.randn(26 * 2**20 + 3)
    mgr = ckpt.CheckpointManager(s3.url, storage_options=s3.storage_options, async_save=True)
    mgr.save(5, model={"w": w})
    mgr.close()
    rel = data_file(Root(s3.url, s3.storage_options), 5)
    head = s3.boto3_client().head_object(Bucket=s3.bucket, Key=f"{s3.prefix}/{rel}")
    assert head["ContentLength"] > 100 * 2**20
    assert "-" in head["ETag"], "expected a multipart ETag (<md5>-<parts>)"
    live = {"w": torch.zeros_like(w)}
    assert mgr.restore_latest(model=live) == 5
    assert torch.equal(live["w"], w)


def test_abort_stale_uploads_removes_open_multipart_uploads_under_the_root(s3: Any) -> None:
    client = s3.boto3_client()
    mine = client.create_multipart_upload(
        Bucket=s3.bucket, Key=f"{s3.prefix}/{step_dir(3)}/r00000-x.safetensors"
    )
    client.upload_part(
        Bucket=s3.bucket, Key=f"{s3.prefix}/{step_dir(3)}/r00000-x.safetensors", UploadId=mine["UploadId"],
        PartNumber=1, Body=b"x" * 2048,
    )  # fmt: skip
    other_key = f"{s3.prefix}-other/x"  # a sibling prefix that merely starts with the same characters
    client.create_multipart_upload(Bucket=s3.bucket, Key=other_key)

    def open_keys() -> list[str]:
        return sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []))

    assert len(open_keys()) == 2
    mgr = ckpt.CheckpointManager(s3.url, storage_options=s3.storage_options, async_save=False, keep_last=2)
    mgr.save(4, model=state(4)).result()  # retention ends with abort_stale_uploads()
    assert open_keys() == [other_key]
    assert mgr.storage.abort_stale_uploads() == 0


def test_committed_step_is_create_only_on_s3(s3: Any) -> None:
    mgr = ckpt.CheckpointManager(s3.url, storage_options=s3.storage_options, async_save=False)
    mgr.save(1, model=state(1)).result()
    with pytest.raises(ckpt.CheckpointExistsError):
        mgr.save(1, model=state(2)).result()
    mgr.save(1, model=state(3), overwrite=True).result()
    live = state(0)
    assert mgr.restore_latest(model=live) == 1
    assert torch.equal(live["w"], state(3)["w"])


def test_retention_never_deletes_a_checkpoint_it_cannot_read(root: Root) -> None:
    """A manifest this version cannot parse (written by a newer ckpt, or a transient read error) is not a
    leftover: retention must leave it alone, and restore_latest skips it with a warning."""
    mgr = root.manager(keep_last=3)
    mgr.save(1, model=state(1)).result()
    st = root.storage().child(step_dir(1))
    doc = json.loads(st.read_bytes(MANIFEST_NAME))
    doc["format_version"] = ckpt.FORMAT_VERSION + 1
    st.put_bytes(MANIFEST_NAME, json.dumps(doc).encode(), exclusive=False)
    assert [i.status for i in mgr.list()] == ["damaged"]
    mgr.save(2, model=state(2)).result()
    assert root.steps_on_storage() == [step_dir(1), step_dir(2)]
    assert st.exists(MANIFEST_NAME)


# ------------------------------------------------------------------------------------------------ two gloo ranks


def _mismatch_on_rank_1(rank: int, world: int, root: str) -> str:
    """Both ranks save step 1; on restore only rank 1's model has another shape. Returns what each rank saw."""
    torch.manual_seed(0)
    mgr = ckpt.CheckpointManager(root, async_save=False)
    mgr.save(1, model={"w": torch.ones(4, 3)})
    live = {"w": torch.zeros(4, 3) if rank == 0 else torch.zeros(5, 3)}
    try:
        mgr.restore_latest(model=live)
    except ckpt.StateMismatchError as e:
        return f"mismatch: {e}"
    return "restored"


def test_a_mismatch_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    """One rank's objects do not fit: every rank raises together (none falls back, none waits for the others)."""
    from conftest import run_ranks

    seen = run_ranks(_mismatch_on_rank_1, 2, str(tmp_path / "run"))
    assert all(s.startswith("mismatch:") and "'w'" in s and "step 1" in s for s in seen), seen
