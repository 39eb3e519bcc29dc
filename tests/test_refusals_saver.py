"""No silent loss in the multi-rank saver (issue 9): replicated state is compared across ranks (xxh3 digests,
all-gathered) on the first save of a Checkpointer / CheckpointManager and on every save with ``verify_replicas``;
a desynchronised replica refuses the save on every rank, naming the tensor and the ranks, and nothing is committed.
Neuron saves on several ranks need parallel sizes that multiply to the world size.  Real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt import SaveOptions
from ckpt.errors import CkptError
from tests.conftest import run_ranks


def _model(rank: int, drift: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    if drift and rank == 2:
        with torch.no_grad():
            m[1].bias[0] += 1e-6  # a desynchronised DDP replica
    return m


def _try(fn) -> str:  # noqa: ANN001
    try:
        fn()
    except CkptError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def ddp_job(rank: int, world: int, root: str) -> dict[str, str]:
    from ckpt import Checkpointer, CheckpointManager

    out: dict[str, str] = {}
    ck = Checkpointer()
    out["first_drift"] = _try(lambda: ck.save(f"{root}/a", step=1, model=_model(rank, True)).result())
    ck = Checkpointer()
    out["first_equal"] = _try(lambda: ck.save(f"{root}/b", step=1, model=_model(rank, False)).result())
    out["later_drift_unchecked"] = _try(
        lambda: ck.save(f"{root}/c", step=2, model=_model(rank, True)).result()
    )
    out["later_drift_checked"] = _try(
        lambda: ck.save(
            f"{root}/d", step=3, model=_model(rank, True), options=SaveOptions(verify_replicas=True)
        ).result()
    )
    ck = Checkpointer(verify_replicas=True)
    ck.save(f"{root}/e", step=1, model=_model(rank, False)).result()
    out["always_drift"] = _try(lambda: ck.save(f"{root}/f", step=2, model=_model(rank, True)).result())
    mgr = CheckpointManager(f"{root}/run", async_save=True)
    out["manager_first_drift"] = _try(lambda: mgr.save(1, model=_model(rank, True)).result())
    mgr.close()
    return out


def test_diverged_replicas_refuse_the_save_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(ddp_job, 3, str(tmp_path))
    for r in results:
        for key in ("first_drift", "later_drift_checked", "always_drift", "manager_first_drift"):
            msg = r[key]
            assert msg.startswith("ReplicaMismatchError: "), (key, msg)
            assert "1.bias" in msg and "ranks [0, 1]; rank [2] hold different values" in msg, msg
        assert r["first_equal"] == "ok" and r["later_drift_unchecked"] == "ok"
    for name in ("a", "d", "f", "run/step_00000001"):
        assert not (tmp_path / name / "manifest.json").exists(), name
    assert (tmp_path / "b" / "manifest.json").exists() and (tmp_path / "c" / "manifest.json").exists()


# --------------------------------------------------------------------------------- Neuron saver


def _try_neuron(root: str, **kw) -> str:  # noqa: ANN003
    from ckpt.neuron import NeuronCheckpointer

    torch.manual_seed(0)  # the same replicated values on every rank
    model = torch.nn.Module()
    model.add_module("norm", torch.nn.Module())
    model.norm.register_parameter("weight", torch.nn.Parameter(torch.ones(4)))
    model.add_module("router", torch.nn.Linear(4, 4, bias=False))

    def save() -> None:
        ck = NeuronCheckpointer(**kw)
        try:
            ck.save(root, step=1, model=model).result()
        finally:
            ck.close()

    return _try(save)


def neuron_job(rank: int, world: int, root: str) -> dict[str, str]:
    tp = dict(tp_rank=rank, tp_size=world)
    return {
        "no_state": _try_neuron(f"{root}/a"),
        "wrong_product": _try_neuron(f"{root}/b", tp_rank=rank % 2, tp_size=2) if world == 4 else "n/a",
        "unknown_name": _try_neuron(f"{root}/c", **tp),
        "declared": _try_neuron(f"{root}/d", replicated=["router.*"], **tp),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_neuron_saver_refusals_on_gloo_ranks(tmp_path: Path, world: int) -> None:
    results = run_ranks(neuron_job, world, str(tmp_path))
    for r in results:
        assert r["no_state"].startswith("LayoutError: Neuron save on ") and "pass tp_size=" in r["no_state"]
        assert f"on {world} ranks" in r["no_state"]
        if world == 4:
            assert r["wrong_product"].startswith(
                "LayoutError: parallel sizes tp 2 x pp 1 x dp 1 x ep 1 = 2"
            ), r
            assert "the process group has 4 ranks" in r["wrong_product"]
        assert r["unknown_name"].startswith("LayoutError: 1 tensor matches no rule"), r["unknown_name"]
        assert "router.weight" in r["unknown_name"] and "--replicated GLOB" in r["unknown_name"]
        assert r["declared"] == "ok"
    for name in "abc":
        assert not (tmp_path / name / "manifest.json").exists()
    from ckpt import open_checkpoint

    m = open_checkpoint(str(tmp_path / "d")).manifest
    assert m.tensors["router.weight"].partition is None and m.extra["nxd"]["replicated"] == ["router.*"]
    assert m.layout.tp == world


def test_one_rank_without_nxd_state_still_saves(tmp_path: Path) -> None:
    assert _try_neuron(str(tmp_path / "a")) == "ok"  # one process: tp = pp = dp = 1 is the truth
    msg = _try_neuron(str(tmp_path / "b"), tp_rank=0, tp_size=2)
    assert msg.startswith("LayoutError: parallel sizes tp 2 x pp 1 x dp 1 x ep 1 = 2") and "has 1 rank" in msg


# --------------------------------------------------------------------------------- ZeRO-1 DP facts


def zero1_job(rank: int, world: int, root: str) -> dict[str, str]:
    from ckpt.neuron import NeuronCheckpointer
    from tests.test_neuron_multirank import TP, FakeZero1, Holder, _rank_files

    tp, dp = rank % TP, rank // TP
    tensors, zsd = _rank_files(tp, dp)
    model = Holder(tensors)
    ck = NeuronCheckpointer(rule_set=None, tp_rank=tp, tp_size=TP, dp_rank=dp, dp_size=world // TP)
    out = {}
    for mode in ("with_attrs", "no_attrs", "disagree"):
        opt = FakeZero1(model, zsd, dp, world // TP)
        if mode == "no_attrs":
            del opt.local_rank, opt.local_world_size
        elif mode == "disagree":
            opt.local_rank, opt.local_world_size = 0, 1
        out[mode] = _try(
            lambda o=opt, m=mode: ck.save(f"{root}/{m}", step=3, model=model, optimizer=o).result()
        )
    ck.close()
    return out


def test_zero1_dp_taken_from_layout_or_refused(tmp_path: Path) -> None:
    from ckpt import open_checkpoint

    for r in run_ranks(zero1_job, 4, str(tmp_path)):
        assert r["with_attrs"] == "ok" and r["no_attrs"] == "ok", r
        assert r["disagree"].startswith("StateMismatchError: ZeRO-1 optimizer shards over 1 rank as"), r
    assert not (tmp_path / "disagree" / "manifest.json").exists()
    a, b = open_checkpoint(str(tmp_path / "with_attrs")), open_checkpoint(str(tmp_path / "no_attrs"))
    names = sorted(a.names("optimizer_state"))
    assert names and names == sorted(b.names("optimizer_state"))
    assert all(torch.equal(a.read(n), b.read(n)) for n in names)
