"""Every local step belongs to its run (issue 37, item 1), and the tiers' agreed restore ends on every rank with a
failing rank's reason (item 7), on 2 real gloo ranks as 2 nodes, each node with its own ``local_dir``, replicas on
the other node.

A run is its persistent root: a crash and restart on the same root restores the run's own local step; a new run on
a reused ``local_dir`` (a different root) restores nothing of it and names it; two runs on one ``local_dir`` at once
each restore their own; a local step whose manifest records no run id, or a garbled one, is named, never restored,
and never deleted by the run's retention.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_ranks

import ckpt
from ckpt.format.schema import seal

pytestmark = pytest.mark.timeout(120)


def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def values(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def manager(tmp: Path, root: str, rank: int, **kw: Any) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(
        str(tmp / root), local_dir=str(tmp / f"node{rank}"), local_every=2, persist_every=100, replicas=1,
        node_rank=rank, async_save=False, **kw,
    )  # fmt: skip


def restore(mgr: ckpt.CheckpointManager, seed: int) -> tuple[int | None, str | None, list[Any], list[str]]:
    model, opt = make(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = mgr.restore_latest(model=model, optimizer=opt)
    tier = mgr.last_restore.tier if step is not None and mgr.last_restore is not None else None
    return step, tier, values(model), [str(w.message) for w in caught]


def save(mgr: ckpt.CheckpointManager, step: int, seed: int) -> list[Any]:
    model, opt = make(seed)
    mgr.save(step, model=model, optimizer=opt)
    return values(model)


def run_of(tmp: Path, root: str) -> str:
    return json.loads((tmp / root / "run.json").read_text())["run_id"]


def steps(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("step_"))


def relabel(folder: Path, src: int, dst: int, run_id: Any) -> None:
    """A copy of step ``src`` as step ``dst`` whose manifest records ``run_id`` (``...``: the member removed, as an
    older ckpt wrote it), re-sealed as any tool that edits a manifest must."""
    shutil.copytree(folder / f"step_{src:08d}", folder / f"step_{dst:08d}")
    path = folder / f"step_{dst:08d}" / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc["step"] = dst
    if run_id is ...:
        doc.pop("run_id")
    else:
        doc["run_id"] = run_id
    path.write_text(seal(doc))


def identity_job(rank: int, world: int, tmp_s: str) -> dict[str, Any]:
    tmp = Path(tmp_s)
    out: dict[str, Any] = {}
    a = manager(tmp, "rootA", rank, keep_local=2)
    out["a2"], out["a4"] = save(a, 2, 1), save(a, 4, 2)
    a.close()  # the job dies here
    # crash and restart on the same root: the same run, its newest local step
    a = manager(tmp, "rootA", rank, keep_local=2)
    out["restart"] = restore(a, 9)
    # a new run on the reused local_dir: nothing of run A restored, run A's steps named in one warning
    b = manager(tmp, "rootB", rank, keep_local=1)
    out["new_run"] = restore(b, 9)
    # both runs at once on one local_dir, at the same step numbers; B keeps 1 local step, A 2
    for step in (6, 8):
        out[f"a{step}"] = save(a, step, 10 + step)
        out[f"b{step}"] = save(b, step, 20 + step)
    out["both_a"], out["both_b"] = restore(a, 9), restore(b, 9)
    folder_a = tmp / f"node{rank}" / f"run-{run_of(tmp, 'rootA')}"
    folder_b = tmp / f"node{rank}" / f"run-{run_of(tmp, 'rootB')}"
    out["listing_after_both"] = {"a": steps(folder_a), "b": steps(folder_b)}
    # steps whose manifest records no run id / a garbled one, in run A's own folder, newer than its newest
    a.coll.barrier()  # every rank listed its node's folders
    if rank == 0:
        for node in ("node0", "node1"):
            f = tmp / node / folder_a.name
            relabel(f, 8, 10, ...)
            relabel(f, 8, 12, "zz not a run id")
    a.coll.barrier()
    out["odd_ids"] = restore(a, 9)
    out["a14"] = save(a, 14, 30)  # retention (keep_local=2) sweeps run A's folder
    out["listing_after_sweep"] = steps(folder_a)
    a.close()
    b.close()
    out["failing"] = failing_job(rank, world, tmp / "failing")  # same processes: one spawn for the module
    return out


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(identity_job, 2, str(tmp_path_factory.mktemp("runid")), timeout=90)


def test_a_run_restarted_on_the_same_root_restores_its_own_local_step(ran: list[dict[str, Any]]) -> None:
    for r in ran:
        step, tier, got, _ = r["restart"]
        assert (step, tier, got) == (4, "local", r["a4"])


def test_a_new_run_on_a_reused_local_dir_restores_nothing_of_the_old_one_and_names_it(
    ran: list[dict[str, Any]],
) -> None:
    for r in ran:
        step, _, got, _ = r["new_run"]
        assert step is None and got != r["a4"]
    (warning,) = [w for w in ran[0]["new_run"][3] if "other runs" in w]  # one warning, on rank 0
    assert "this run: none recorded yet" in warning
    for node in ("node0", "node1"):
        for s in (2, 4):
            assert f"{node}/run-" in warning and f"/step_{s:08d} (run " in warning
    assert not [w for w in ran[1]["new_run"][3] if "other runs" in w]


def test_two_runs_on_one_local_dir_at_once_each_restore_their_own(ran: list[dict[str, Any]]) -> None:
    for r in ran:
        assert r["both_a"][:3] == (8, "local", r["a8"])
        assert r["both_b"][:3] == (8, "local", r["b8"])
        assert r["a8"] != r["b8"]
        # each run's retention swept its own folder only
        assert r["listing_after_both"] == {"a": ["step_00000006", "step_00000008"], "b": ["step_00000008"]}


def test_a_step_with_no_or_a_garbled_run_id_is_named_never_restored_never_deleted(
    ran: list[dict[str, Any]],
) -> None:
    for r in ran:
        step, tier, got, _ = r["odd_ids"]
        assert (step, tier, got) == (8, "local", r["a8"])
        # keep_local=2 of run A's own (8, 14): 6 dropped; 10 and 12 are not positively A's, so never deleted
        assert r["listing_after_sweep"] == [
            "step_00000008",
            "step_00000010",
            "step_00000012",
            "step_00000014",
        ]
    (warning,) = [w for w in ran[0]["odd_ids"][3] if "other runs" in w]
    assert "step_00000010 (no run id, or a garbled one)" in warning
    assert "step_00000012 (no run id, or a garbled one)" in warning
    assert "rootB" not in warning and "step_00000008 (run " in warning  # run B's step is named too


# ------------------------------------------------------------------------------------------------ item 7


def failing_job(rank: int, world: int, tmp_s: str | Path) -> dict[str, str]:
    """Rank 1's ``local_dir`` turns out to be a file: at construction, then (another folder) after it."""
    tmp = Path(tmp_s)
    tmp.mkdir(exist_ok=True)
    out = {}
    if rank == 1:
        (tmp / "node1").write_text("not a folder")
    try:
        manager(tmp, "root", rank)
        out["construct"] = "no error"
    except ckpt.CkptError as e:
        out["construct"] = str(e)
    mgr = ckpt.CheckpointManager(
        str(tmp / "root2"), local_dir=str(tmp / f"ok{rank}"), local_every=1, node_rank=rank, async_save=False
    )
    save(mgr, 1, 1)
    if rank == 1:  # the node's disk is gone from under the run
        shutil.rmtree(tmp / "ok1")
        (tmp / "ok1").write_text("not a folder")
    model, opt = make(2)
    try:
        mgr.restore_latest(model=model, optimizer=opt)
        out["restore"] = "no error"
    except ckpt.CkptError as e:
        out["restore"] = str(e)
    # a rank whose optimizer refuses the restored state with an unexpected error (a pre-hook of its own)
    mgr = ckpt.CheckpointManager(
        str(tmp / "root3"), local_dir=str(tmp / f"ok3{rank}"), local_every=1, node_rank=rank, async_save=False
    )
    save(mgr, 1, 1)
    model, opt = make(2)
    if rank == 1:

        def refuse(optimizer: Any, state: Any) -> None:
            raise RuntimeError("this optimizer refuses restored state")

        opt.register_load_state_dict_pre_hook(refuse)
    try:
        mgr.restore_latest(model=model, optimizer=opt)
        out["load"] = "no error"
    except ckpt.CkptError as e:
        out["load"] = str(e)
    return out


def test_a_rank_failing_in_the_agreed_restore_ends_every_rank_with_its_reason(
    ran: list[dict[str, Any]],
) -> None:
    # run_ranks' timeout (90 s) fails the module's job long before the tiers' gloo timeout (30 min) would end it
    for r in (r["failing"] for r in ran):
        assert (
            "reading the run id of" in r["construct"]
            and "rank 1 failed: NotADirectoryError" in r["construct"]
        )
        assert r["restore"].startswith(
            "restore_latest: the local tier's inventory: rank 1 failed: NotADirectoryError"
        )
        assert "ok1" in r["restore"]
        assert "restoring step 1 from " in r["load"]
        assert "rank 1 failed: RuntimeError: this optimizer refuses restored state" in r["load"]


# ------------------------------------------------------------------------------------------------ the format


def test_run_id_is_an_optional_manifest_member_older_manifests_read_as_before(tmp_path: Path) -> None:
    from ckpt.errors import ManifestError
    from ckpt.format.manifest import Manifest

    model, opt = make(0)
    with ckpt.CheckpointManager(
        str(tmp_path / "root"), local_dir=str(tmp_path / "l"), async_save=False
    ) as mgr:
        mgr.save(1, model=model, optimizer=opt)
        rid = run_of(tmp_path, "root")
        (run,) = (tmp_path / "l").glob("run-*")
        raw = (run / "step_00000001" / "manifest.json").read_bytes()
    assert run.name == f"run-{rid}" and Manifest.from_json(raw).run_id == rid
    doc = json.loads(raw)
    doc.pop("run_id")
    assert Manifest.from_json(seal(doc)).run_id is None  # as every older manifest: absent
    doc["run_id"] = 7
    with pytest.raises(ManifestError, match="field 'run_id' must be a string or null, got int"):
        Manifest.from_json(seal(doc), "m.json")
