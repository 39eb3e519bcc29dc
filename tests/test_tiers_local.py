"""The node-local tier in one process: local saves in the checkpoint format under ``local_dir``, the persistent
tier (a real S3 API: moto behind a logging proxy) touched only by persistent steps, restores from the newest step
complete in any tier, retention per tier, and a SageMaker-style partial sync of ``local_dir`` (issue 26)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REAL_S3_URL
from torture.faultproxy import fault_proxy

import ckpt
from ckpt.errors import CkptError
from ckpt.format.reader import read_manifest
from ckpt.storage import open_storage

pytestmark = [pytest.mark.timeout(120)]


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[bytes]:
    out = [t.detach().numpy().tobytes() for t in model.state_dict().values()]
    for st in opt.state_dict()["state"].values():
        out += [v.numpy().tobytes() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def steps_in(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("step_")) if folder.exists() else []


def run_folder(local: Path) -> Path:
    """The one run's folder under ``local`` (``run-<id>``, the id its root records)."""
    (name,) = [n for n in os.listdir(local) if n.startswith("run-")]
    return local / name


@pytest.mark.s3
@pytest.mark.skipif(
    bool(REAL_S3_URL), reason="the request-logging proxy speaks plain HTTP to a loopback moto server"
)
def test_local_saves_never_touch_the_object_store_and_restore_prefers_the_newest_tier(
    s3: Any, tmp_path: Path
) -> None:
    local = tmp_path / "nvme"
    with fault_proxy(s3.endpoint) as proxy:
        options = {"client_kwargs": {"endpoint_url": proxy.url}}
        model, opt = make()
        mgr = ckpt.CheckpointManager(
            s3.url,
            storage_options=options,
            local_dir=str(local),
            local_every=2,
            persist_every=4,
            async_save=True,
        )
        before = len(proxy.log)
        snaps, requests = {}, {}
        for step in range(1, 7):
            train_step(model, opt, step)
            fut = mgr.save(step, model=model, optimizer=opt)
            if step % 2:
                assert fut.result() is None  # no tier takes odd steps
                continue
            mgr.wait()
            snaps[step] = state_bytes(model, opt)
            new = [(r.method, r.target.rsplit("/", 2)[-2:]) for r in proxy.log[before:]]
            requests[step] = len(new)
            if step == 2:  # the run's first save records its id in the root (create-only), and only that
                assert new == [("PUT", ["run", "run.json"])], new
            if step == 6:  # a local-only save: not one request to the object store
                assert new == [], new
            before = len(proxy.log)
        mgr.close()
        assert requests[4] > 0  # step 4 went there
    # the persistent tier holds step 4 only; its copy is a complete checkpoint in the same format
    assert [i.step for i in ckpt.list_checkpoints(s3.url, storage_options=s3.storage_options)] == [4]
    persisted = read_manifest(open_storage(f"{s3.url}/step_00000004", s3.storage_options))
    run = run_folder(local)
    assert persisted == read_manifest(open_storage(str(run / "step_00000004")))
    # the local tier: the keep_local=2 newest steps, each a committed checkpoint ckpt reads as any other
    assert steps_in(run) == ["step_00000004", "step_00000006"]
    assert not (run / ".pending").exists()  # swept after the commit
    assert read_manifest(open_storage(str(run / "step_00000006"))).step == 6

    def restart(seed: int, step: int, tier: str) -> None:
        model, opt = make(seed)
        with ckpt.CheckpointManager(
            s3.url, storage_options=s3.storage_options, local_dir=str(local), local_every=2, persist_every=4
        ) as mgr:
            assert mgr.restore_latest(model=model, optimizer=opt) == step
            assert mgr.last_restore is not None and mgr.last_restore.tier == tier
        assert state_bytes(model, opt) == snaps[step]

    restart(1, 6, "local")  # the newest step is local
    shutil.rmtree(local)  # the node was replaced (empty local_dir): the persistent step 4
    restart(2, 4, "persistent")


def test_without_local_dir_nothing_changes(tmp_path: Path) -> None:
    model, opt = make()
    with ckpt.CheckpointManager(str(tmp_path / "run"), async_save=False) as mgr:
        for step in (1, 2, 3):
            train_step(model, opt, step)
            assert mgr.save(step, model=model, optimizer=opt).result().step == step
        assert [i.step for i in mgr.list()] == [1, 2, 3]
        assert mgr.restore_latest(model=model, optimizer=opt) == 3
        assert mgr.last_restore is not None and mgr.last_restore.tier == "persistent"


def test_local_steps_older_than_the_newest_persistent_one_are_dropped(tmp_path: Path) -> None:
    model, opt = make()
    local = tmp_path / "shm"
    with ckpt.CheckpointManager(
        str(tmp_path / "run"),
        local_dir=str(local),
        local_every=1,
        persist_every=3,
        keep_local=5,
        async_save=False,
    ) as mgr:
        for step in range(1, 5):
            train_step(model, opt, step)
            mgr.save(step, model=model, optimizer=opt)
            if step == 2:
                assert steps_in(run_folder(local)) == ["step_00000001", "step_00000002"]
    # step 3 went to both tiers: 1 and 2 are older than it and were dropped; 4 is local only
    assert steps_in(run_folder(local)) == ["step_00000003", "step_00000004"]
    assert [i.step for i in ckpt.list_checkpoints(str(tmp_path / "run"))] == [3]


@pytest.mark.parametrize("damage", ["data file missing", "manifest missing", "index missing"])
def test_a_partially_synced_local_step_is_skipped_never_restored_half(tmp_path: Path, damage: str) -> None:
    """SageMaker copies /opt/ml/checkpoints back from S3 in any file order: a job restarted while that copy was
    partial sees a step with its manifest but not every data file, or files without their manifest."""
    local = tmp_path / "opt-ml-checkpoints"
    model, opt = make()
    snaps = {}
    with ckpt.CheckpointManager(
        str(tmp_path / "s3"), local_dir=str(local), local_every=1, persist_every=100, async_save=False
    ) as mgr:
        for step in (1, 2):
            train_step(model, opt, step)
            mgr.save(step, model=model, optimizer=opt)
            snaps[step] = state_bytes(model, opt)
    newest = run_folder(local) / "step_00000002"
    names = os.listdir(newest)
    victim = {
        "data file missing": next(n for n in names if n.endswith(".safetensors")),
        "manifest missing": "manifest.json",
        "index missing": next(n for n in names if n.endswith(".index.json")),
    }[damage]
    (newest / victim).unlink()
    model2, opt2 = make(seed=3)
    with ckpt.CheckpointManager(
        str(tmp_path / "s3"), local_dir=str(local), local_every=1, persist_every=100
    ) as mgr2:
        if damage == "manifest missing":
            got = mgr2.restore_latest(model=model2, optimizer=opt2)
        else:
            with pytest.warns(UserWarning, match=f"local step 2: no node holds an intact .*{victim}"):
                got = mgr2.restore_latest(model=model2, optimizer=opt2)
    assert got == 1
    assert state_bytes(model2, opt2) == snaps[1]


def test_bad_tier_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CkptError, match=r"replicas=1 needs at least 2 nodes; this job has 1"):
        ckpt.CheckpointManager(str(tmp_path / "r"), local_dir=str(tmp_path / "l"), replicas=1)
    with pytest.raises(CkptError, match=r"local_every=5 needs local_dir="):
        ckpt.CheckpointManager(str(tmp_path / "r"), local_every=5)
    with pytest.raises(CkptError, match=r"persist_every=0: expected a positive integer"):
        ckpt.CheckpointManager(str(tmp_path / "r"), local_dir=str(tmp_path / "l"), persist_every=0)
    with pytest.raises(CkptError, match=r"local_dir= with process_group=: the tiers' group spans every rank"):
        ckpt.CheckpointManager(str(tmp_path / "r"), local_dir=str(tmp_path / "l"), process_group=object())
    with pytest.raises(CkptError, match=r"local_dir='s3://b/x': expected a node-local folder"):
        ckpt.CheckpointManager(str(tmp_path / "r"), local_dir="s3://b/x")


def test_the_ledger_records_each_restore_tier_and_report_prices_recovery_per_tier(tmp_path: Path) -> None:
    import json

    from ckpt.cli.report import report
    from click.testing import CliRunner

    from ckpt.resume.ledger import LedgerWriter

    run, local = tmp_path / "run", tmp_path / "local"

    def session(first: int, last: int, wipe: bool = False, clean: bool = False) -> None:
        if wipe:
            shutil.rmtree(local)
        model, opt = make()
        ledger = LedgerWriter(run)
        mgr = ckpt.CheckpointManager(
            str(run / "ckpt"), local_dir=str(local), local_every=2, persist_every=4,
            async_save=False, on_event=ledger.on_event,
        )  # fmt: skip
        start = mgr.restore_latest(model=model, optimizer=opt) or 0
        for step in range(start + 1, last + 1):
            ledger.step(step, train_step(model, opt, step), 0.01)
            mgr.save(step, model=model, optimizer=opt)
        mgr.close()
        ledger.close(clean=clean)

    session(1, 7)  # dies after step 7: local step 6, persistent 4
    session(7, 9)  # restores local 6, dies after 9: local 8 (persistent too)
    session(9, 11, wipe=True, clean=True)  # a replaced node: persistent 8
    events = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    assert [(e["step"], e["tier"]) for e in events if e["kind"] == "restore"] == [
        (6, "local"),
        (8, "persistent"),
    ]
    doc = json.loads(CliRunner().invoke(report, [str(run), "--json"]).output)
    assert [(f["restored_step"], f["tier"]) for f in doc["failures"]] == [(6, "local"), (8, "persistent")]
    assert [(t["tier"], t["failures"], t["steps_recomputed"]) for t in doc["tiers"]] == [
        ("local", 1, 1),
        ("persistent", 1, 1),
    ]
    text = CliRunner().invoke(report, [str(run)]).output
    assert "Recovery cost per tier" in text and "persistent" in text


def test_an_unreachable_object_store_does_not_stop_a_restore_from_the_local_tier(tmp_path: Path) -> None:
    model, opt = make()
    local = tmp_path / "nvme"
    options = {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    with ckpt.CheckpointManager(
        "s3://nowhere/run", storage_options=options, local_dir=str(local), local_every=1, persist_every=100,
        async_save=False,
    ) as mgr:  # fmt: skip
        train_step(model, opt, 1)
        # local only: the store is asked once, for the run's record, and the save goes on without it
        with pytest.warns(UserWarning, match=r"cannot record this run's id in s3://nowhere/run/run.json .*: "
                          r"recorded in .*nvme/run-[0-9a-f]{16}/run.json only"):  # fmt: skip
            mgr.save(1, model=model, optimizer=opt)
    want = state_bytes(model, opt)
    model2, opt2 = make(seed=4)
    with pytest.warns(UserWarning, match=r"this run's id [0-9a-f]{16} is taken from .*nvme/run-[0-9a-f]{16}/run.json"):
        mgr2 = ckpt.CheckpointManager(
            "s3://nowhere/run", storage_options=options, local_dir=str(local), persist_every=100
        )
    with mgr2:
        with pytest.warns(
            UserWarning, match="cannot list the persistent tier, restoring from local steps only"
        ):
            assert mgr2.restore_latest(model=model2, optimizer=opt2) == 1
        assert mgr2.last_restore is not None and mgr2.last_restore.tier == "local"
    assert state_bytes(model2, opt2) == want
