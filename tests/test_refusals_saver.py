"""No silent loss in the multi-rank saver (issue 9): replicated state is compared across ranks (xxh3 digests,
all-gathered) on the first save of a Checkpointer / CheckpointManager and on every save with ``verify_replicas``;
a desynchronised replica refuses the save on every rank, naming the tensor and the ranks, and nothing is committed.
Neuron saves on several ranks need parallel sizes that multiply to the world size.  Real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import torch

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
        lambda: ck.save(f"{root}/d", step=3, model=_model(rank, True), verify_replicas=True).result()
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
