"""CkptCheckpointIO inside real Lightning runs: ModelCheckpoint's files are our checkpoints, Lightning's dict comes
back exactly, a SIGKILLed run resumed with ``ckpt_path=`` continues bit-identically, DDP/FSDP on gloo ranks."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("USE_TORCH_XLA", "0")
pytest.importorskip("lightning")

sys.path.insert(0, str(Path(__file__).parent))
import _lightning_run as run  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from conftest import run_ranks  # noqa: E402

from ckpt.integrations.lightning import CkptCheckpointIO  # noqa: E402


class _Recording(CkptCheckpointIO):
    """Keeps a deep copy of every dict Lightning hands over, by path (what load_checkpoint must give back)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.given: dict[str, dict[str, Any]] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.given[os.fspath(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


def same(a: Any, b: Any, where: str = "") -> None:
    """Equal values of the same types, tensors bit for bit (dtype and shape included)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b) or set(a) == set(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def test_model_checkpoint_files_are_ours_and_come_back_exactly(tmp_path: Path) -> None:
    pl.seed_everything(0)
    io = _Recording()
    ckpts = tmp_path / "ckpts"
    trainer = run.trainer(tmp_path, 6, io)
    trainer.fit(run.Tiny(), run.data())
    mc = trainer.checkpoint_callback
    kept = sorted(p.name for p in ckpts.iterdir())
    # top-2 by train_loss, plus last: the others were removed through remove_checkpoint
    assert kept == sorted({Path(p).name for p in mc.best_k_models} | {"last.ckpt"})
    assert len(io.given) > len(kept)  # steps 2, 4, 6 + last: one of them was removed
    for name in kept:
        assert (ckpts / name / "manifest.json").is_file(), name
        same(io.load_checkpoint(ckpts / name), io.given[str(ckpts / name)], name)
    loaded = io.load_checkpoint(ckpts / "last.ckpt")
    assert loaded["global_step"] == 6 and loaded["optimizer_states"][0]["state"][0]["exp_avg"].shape == (8, 4)
    assert not any(n.endswith(".pkl") or n.endswith(".pt") for n in os.listdir(ckpts / "last.ckpt"))


def test_unstorable_hyper_parameter_is_refused_at_the_save_naming_it(tmp_path: Path) -> None:
    io = CkptCheckpointIO(async_save=False)
    with pytest.raises(Exception, match=r"hyper_parameters\.bad"):
        io.save_checkpoint({"global_step": 1, "hyper_parameters": {"bad": object()}}, tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt" / "manifest.json").exists()


def test_sigkilled_run_resumed_with_ckpt_path_gives_bit_identical_losses(tmp_path: Path) -> None:
    env = {**os.environ, "USE_TORCH_XLA": "0", "PJRT_DEVICE": "CPU", "PYTHONPATH": str(Path(__file__).parents[1])}
    script = str(Path(__file__).parent / "_lightning_run.py")
    killed = subprocess.run([sys.executable, script, str(tmp_path), "8", "--kill-at", "5"], env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    last = tmp_path / "ckpts" / "last.ckpt"
    assert (last / "manifest.json").is_file()
    (first,) = tmp_path.glob("losses-*.txt")
    before = first.read_text().split("\n")[:-1]
    # resumed here (a fresh Trainer and module, as a restarted job builds them): one process start fewer
    pl.seed_everything(0, workers=True)
    model = run.Tiny()
    run.trainer(tmp_path, 8, CkptCheckpointIO(), deterministic=True).fit(model, run.data(), ckpt_path=str(last))
    after = [f"{s} {loss.hex()}" for s, loss in model.losses]
    assert after[0].startswith("4 "), after  # last.ckpt is step 4: the run continues from there
    got = [line for line in before if int(line.split()[0]) < 4] + after

    pl.seed_everything(0, workers=True)
    model = run.Tiny()
    run.trainer(tmp_path / "reference", 8, CkptCheckpointIO(), deterministic=True).fit(model, run.data())
    want = [f"{s} {loss.hex()}" for s, loss in model.losses]
    assert got == want


def _ranks_fit(rank: int, world: int, root: str, strategy: str) -> dict[str, Any]:
    """One rank of a Lightning job on gloo: fit 4 steps saving through the plugin, then (DDP) resume to 6."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # launched externally: Lightning spawns nothing
    pl.seed_everything(0)
    io = _Recording()
    trainer = run.trainer(Path(root), 4, io, strategy=strategy, devices=world)
    trainer.fit(run.Tiny(), run.data())
    last = Path(root) / "ckpts" / "last.ckpt"
    out: dict[str, Any] = {"saved": sorted(io.given)}
    if rank == 0:
        same(io.load_checkpoint(last), io.given[str(last)], "last.ckpt")
    if strategy == "ddp":
        loaded = io.load_checkpoint(last)
        same(dict(loaded["state_dict"]), dict(trainer.lightning_module.state_dict()), "state_dict")
        again = run.trainer(Path(root), 6, CkptCheckpointIO(), strategy=strategy, devices=world)
        again.fit(run.Tiny(), run.data(), ckpt_path=str(last))
        out["resumed_to"] = again.global_step
    return out


def test_ddp_on_gloo_ranks_saves_once_from_rank_zero_and_resumes(tmp_path: Path) -> None:
    # FSDP is not run here: Lightning's FSDPStrategy refuses accelerator="cpu", and bypassing that, torch 2.9's
    # FSDP1 full-state-dict hook segfaults on CPU ranks at the first save (Lightning's own CheckpointIO too)
    first, second = run_ranks(_ranks_fit, 2, str(tmp_path), "ddp", timeout=240)
    assert first["saved"] and second["saved"] == []  # Lightning hands the plugin the dict on rank 0 only
    assert (tmp_path / "ckpts" / "last.ckpt" / "manifest.json").is_file()
    assert first["resumed_to"] == second["resumed_to"] == 6


def test_a_failed_background_write_fails_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer fails after save_checkpoint returned (the fault injected as tests/test_core_async.py does):
    Lightning's fit raises it (from the next save or from teardown), and no checkpoint is committed."""
    import ckpt.format.publish
    from ckpt.errors import AsyncSaveError

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk on fire")

    monkeypatch.setattr(ckpt.format.publish, "write_data_file", broken)
    pl.seed_everything(0)
    trainer = run.trainer(tmp_path, 2, CkptCheckpointIO(), logger=False)
    with pytest.raises(AsyncSaveError, match="disk on fire"):
        trainer.fit(run.Tiny(), run.data())
    assert not list(tmp_path.rglob("manifest.json"))


def test_node_local_tier_writes_locally_and_persists_whole_copies(tmp_path: Path) -> None:
    from ckpt.integrations.lightning_tier import local_path

    pl.seed_everything(0)
    io = _Recording(local_dir=tmp_path / "nvme")
    trainer = run.trainer(tmp_path, 6, io, logger=False)
    trainer.fit(run.Tiny(), run.data())
    ckpts = tmp_path / "ckpts"
    kept = sorted(p.name for p in ckpts.iterdir())
    assert "last.ckpt" in kept and len(kept) == 3
    local_root = Path(local_path(str(tmp_path / "nvme"), str(ckpts / "x"))).parent
    assert sorted(p.name for p in local_root.iterdir()) == kept  # the removed one is gone from both tiers
    for name in kept:
        here, there = local_root / name, ckpts / name
        files = sorted(str(p.relative_to(here)) for p in here.rglob("*") if p.is_file())
        assert files == sorted(str(p.relative_to(there)) for p in there.rglob("*") if p.is_file())
        assert all((here / f).read_bytes() == (there / f).read_bytes() for f in files), name
        # the persistent copy alone (another node, no local copy) gives Lightning's dict back
        same(CkptCheckpointIO().load_checkpoint(there), io.given[str(there)], name)
    same(io.load_checkpoint(ckpts / "last.ckpt"), io.given[str(ckpts / "last.ckpt")], "local")
