"""Resuming on another number of ranks: the data position continues exactly, RNG streams follow the rule.

Real gloo ranks, three spawned jobs in all: 2 ranks save; 4 ranks save and restore the 2-rank checkpoint; 2 ranks
restore the 4-rank checkpoints (directly, with another global batch, and through ``ckpt convert --to neuron --dp 2``
and back).  4 -> 1 runs in the test process.  Every supported loader is saved at once: a StatefulDataLoader over a
DistributedSampler, a plain DataLoader through ``ckpt.data.track``, a Hugging Face ``datasets.Dataset`` under a
StatefulDataLoader, and HF map-style and (buffer-shuffled) IterableDatasets split by ``ckpt.data.split_dataset_by_node``;
loaders ckpt cannot re-split (a RandomSampler, an HF IterableDataset split with datasets' own
``split_dataset_by_node``) are refused, and a user adapter registered with ``ckpt.data.register`` re-splits its own.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckpt.cli.main import cli
from click.testing import CliRunner
from conftest import run_ranks

import ckpt
import ckpt.data
from ckpt.data import DataPosition, RankPosition, track
from ckpt.errors import StateMismatchError

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "fixtures" / "nxd" / "llama_gqa_h64" / "config.json"
N = 70  # not a multiple of 4: DistributedSampler pads the epoch's list to 72
GLOBAL_BATCH = 8
SAVE_AT = 3  # global steps consumed before the save
AFTER = 4  # global steps compared after it
KINDS = ("stateful", "plain", "hf", "hf_split", "hf_stream")
SEED = 11


# ------------------------------------------------------------------------------------------------ loaders


def _dataset(kind: str) -> Any:
    if kind == "hf":
        import datasets

        return datasets.Dataset.from_dict({"idx": list(range(N))}).with_format("torch")
    return list(range(N))


def _loader(kind: str, rank: int, world: int, per_rank: int) -> Any:
    from torch.utils.data import DataLoader, DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    if kind == "random":  # a per-rank RandomSampler: no global order ckpt could re-split
        g = torch.Generator().manual_seed(rank)
        return StatefulDataLoader(list(range(N)), batch_size=per_rank, shuffle=True, generator=g)
    if kind == "hf_iterable":
        import datasets
        from datasets.distributed import split_dataset_by_node

        full = datasets.Dataset.from_dict({"idx": list(range(N))}).to_iterable_dataset(num_shards=4)
        return StatefulDataLoader(split_dataset_by_node(full, rank, world), batch_size=per_rank)
    if kind == "custom":
        return Strided(rank, world, per_rank)
    if (
        kind == "hf_stream"
    ):  # ckpt's re-splittable split of an HF IterableDataset, buffer-shuffled with a seed
        import datasets

        full = datasets.Dataset.from_dict({"idx": list(range(N))}).to_iterable_dataset(num_shards=3)
        stream = full.shuffle(seed=SEED, buffer_size=16)
        return StatefulDataLoader(ckpt.data.split_dataset_by_node(stream, rank, world), batch_size=per_rank)
    if kind == "hf_split":  # ckpt's re-splittable split_dataset_by_node of a map-style HF dataset
        return StatefulDataLoader(
            ckpt.data.split_dataset_by_node(_dataset("hf"), rank, world), batch_size=per_rank
        )
    ds = _dataset(kind)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    if kind == "plain":
        return track(DataLoader(ds, batch_size=per_rank, sampler=sampler))
    return StatefulDataLoader(ds, batch_size=per_rank, sampler=sampler)


class Strided:
    """A user's loader: rank r of W reads r, r+W, r+2W, ... from ``start``, ``batch`` samples per step."""

    def __init__(self, rank: int, world: int, batch: int) -> None:
        self.rank, self.world, self.batch, self.start, self.taken = rank, world, batch, 0, 0

    def __iter__(self) -> Any:
        while True:
            ids = [self.start + self.rank + (self.taken + j) * self.world for j in range(self.batch)]
            if ids[-1] >= N:
                return
            self.taken += self.batch
            yield ids

    def state_dict(self) -> dict[str, int]:
        return {"start": self.start, "taken": self.taken}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start, self.taken = state["start"], state["taken"]


class StridedAdapter:
    """The documented hook: position (per rank, at a save) and reposition (at a restore on any DP size)."""

    name = "strided"

    def matches(self, loader: Any) -> bool:
        return isinstance(loader, Strided)

    def position(self, loader: Strided) -> RankPosition:
        return RankPosition(
            self.name, 0, loader.start, loader.taken, loader.batch, {"kind": "strided", "n": N}
        )

    def reposition(self, loader: Strided, position: DataPosition, rank: int, world: int, where: str) -> None:
        loader.start, loader.taken = position.samples, 0


def _ids(batch: Any) -> list[int]:
    if isinstance(batch, dict):
        batch = batch["idx"]
    return [int(x) for x in batch]


def _tiny() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(4, dtype=torch.float64) / 10}


def _train(model: dict[str, torch.Tensor], ids: list[int], global_batch: int) -> float:
    """One SGD step of a linear model on the global batch (data-parallel: gradients summed over ranks); the loss."""
    import torch.distributed as dist

    i = torch.tensor(ids, dtype=torch.float64)
    x = torch.sin(i[:, None] * torch.arange(1, 5, dtype=torch.float64) * 0.1)
    err = x @ model["w"] - torch.cos(i * 0.3)
    sums = torch.cat([(err**2).sum()[None], 2 * err @ x])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    model["w"] -= 0.1 * sums[1:] / global_batch
    return float(sums[0] / global_batch)


def llama_state(zeros: bool = False) -> dict[str, torch.Tensor]:
    """A Llama state dict (HF names) of the fixture config, so that ``ckpt convert`` can re-lay it out."""
    cfg = json.loads(CONFIG.read_text())
    h, v, i, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    g = torch.Generator().manual_seed(0)
    return {n: torch.zeros(s) if zeros else torch.randn(s, generator=g) for n, s in shapes.items()}


def _model_for(path: str) -> dict[str, torch.Tensor]:
    """Zero tensors named, shaped and typed like the checkpoint's model tensors (a fresh model to restore into)."""
    from ckpt.format.dtypes import dtype_from_name

    m = ckpt.open_checkpoint(path).manifest
    return {
        n: torch.zeros(t.shape, dtype=dtype_from_name(t.dtype))
        for n, t in m.tensors.items()
        if t.role == "parameter"
    }


# ------------------------------------------------------------------------------------------------ rank jobs


def _save_all(rank: int, world: int, root: str) -> dict[str, Any]:
    """Iterate SAVE_AT steps, save every loader's position, then AFTER more steps (the uninterrupted run)."""
    ckpt.data.register(StridedAdapter())
    random.seed(5)  # identical on every rank: a shared stream, carried to any DP size
    torch.manual_seed(100 + rank)  # per rank: re-derived on another DP size
    np.random.seed(200 + rank)
    per_rank = GLOBAL_BATCH // world
    out: dict[str, Any] = {}
    for k in (*KINDS, "random", "hf_iterable", "custom"):
        loader = _loader(k, rank, world, per_rank)
        it = iter(loader)
        # the stateful run logs a ledger with global sample digests (into two run dirs, one per way of resuming)
        ledgers = (
            [_ledger(f"{root}/run_{v}", rank, world) for v in ("same", "small")] if k == "stateful" else []
        )
        model = llama_state() if k == "stateful" else _tiny()
        trained = None if k == "stateful" else model  # the llama weights only travel through convert
        losses: list[float] = []
        before = [_consume(trained, losses, ledgers, s, _ids(next(it))) for s in range(1, SAVE_AT + 1)]
        ckpt.save(
            f"{root}/{k}",
            step=SAVE_AT,
            model=model,
            dataloader=loader,
            progress={"samples": SAVE_AT * GLOBAL_BATCH},
            rng_seed=1234,
        )
        if (
            k == "plain"
        ):  # the same state as a CheckpointManager's step folder (issue 17's report: restore_latest)
            from ckpt.restoring.discovery import step_dir

            ckpt.save(
                f"{root}/mgr/{step_dir(SAVE_AT)}", step=SAVE_AT, model=model, dataloader=loader, rng_seed=1234
            )
        for ledger in ledgers:
            ledger.save(SAVE_AT, f"{root}/{k}")
        if k == "stateful":
            out["rng_after_save"] = [random.random(), float(np.random.rand()), float(torch.rand(()))]
        losses.clear()
        after = [
            _consume(trained, losses, ledgers, s, _ids(next(it)))
            for s in range(SAVE_AT + 1, SAVE_AT + AFTER + 1)
        ]
        for ledger in ledgers:
            ledger.close(clean=False)  # the "crash": the resumed job continues these ledgers
        out[k] = {"before": before, "after": after, "losses": list(losses)}
    return out


def _consume(model: Any, losses: list[float], ledgers: list[Any], step: int, ids: list[int]) -> list[int]:
    """One step of the uninterrupted run: train (when a model is given), log, return this rank's ids."""
    if model is not None:
        losses.append(_train(model, ids, GLOBAL_BATCH))
    return _step(ledgers, step, ids)


def _ledger(run_dir: str, rank: int, world: int) -> Any:
    from ckpt.resume.ledger import LedgerWriter

    return LedgerWriter(run_dir, world_size=world, enabled=rank == 0)


def _step(
    ledgers: list[Any], step: int, ids: list[int], samples_before: int = 0, batch: int = GLOBAL_BATCH
) -> list[int]:
    """Log one step (collective: every rank's ids go into the global digest) and return this rank's ids."""
    if ledgers:
        digest = ckpt.data.global_digest(ids)
        samples = samples_before + (step - (SAVE_AT if samples_before else 0)) * batch
        for ledger in ledgers:
            ledger.step(step, 1.0 / step, 1e-3, samples=samples, data_digest=digest)
    return ids


def save_job(rank: int, world: int, root: str) -> dict[str, Any]:
    return _save_all(rank, world, root)


def _restore(
    path: str, kind: str, per_rank: int, steps: int | None, run: str | None = None, *, rank: int, world: int
) -> dict[str, Any]:
    loader = _loader(kind, rank, world, per_rank)
    model = _model_for(path)
    try:
        res = ckpt.restore(path, model=model, dataloader=loader)
    except StateMismatchError as e:
        return {"refused": str(e)}
    rng = [random.random(), float(np.random.rand()), float(torch.rand(()))]
    ledgers = [_ledger(run, rank, world)] if run else []
    for ledger in ledgers:
        ledger.restore(res.step, path, 0.1)
    it = iter(loader)
    batches = [_ids(b) for b in it] if steps is None else [_ids(next(it)) for _ in range(steps)]
    for i, ids in enumerate(batches):
        _step(ledgers, res.step + 1 + i, ids, SAVE_AT * GLOBAL_BATCH, per_rank * world)
    for ledger in ledgers:
        ledger.close()
    train = steps is not None and "w" in model  # lockstep steps only: collectives
    losses = [_train(model, ids, per_rank * world) for ids in batches] if train else []
    return {
        "batches": batches,
        "losses": losses,
        "mode": res.data.mode,
        "carried": res.rng_carried,
        "derived": res.rng_derived,
        "rng": rng,
    }


def restore_job(
    rank: int, world: int, jobs: list[tuple[Any, ...]], manager: str | None = None
) -> dict[str, Any]:
    """Each job: (label, checkpoint path, loader kind, per-rank batch, steps or None for the rest of the epoch,
    and optionally a run dir whose ledger the resumed steps continue).  ``manager``: a CheckpointManager root
    whose latest checkpoint ``restore_latest`` continues with a plain (tracked) DataLoader."""
    ckpt.data.register(StridedAdapter())
    out = {job[0]: _restore(*job[1:], rank=rank, world=world) for job in jobs}
    if manager is not None:
        loader = _loader("plain", rank, world, GLOBAL_BATCH // world)
        with ckpt.CheckpointManager(manager, async_save=False) as mgr:
            step = mgr.restore_latest(model=_tiny(), dataloader=loader)
            assert mgr.last_restore is not None
            mode = mgr.last_restore.data.mode
        it = iter(loader)
        out["manager"] = {"step": step, "mode": mode, "batches": [_ids(next(it)) for _ in range(AFTER)]}
    return out


def save_and_restore_job(rank: int, world: int, root: str, jobs: list[Any]) -> dict[str, Any]:
    return {"saved": _save_all(rank, world, root), "restored": restore_job(rank, world, jobs)}


# ------------------------------------------------------------------------------------------------ the runs


def global_batches(per_rank: list[list[list[int]]]) -> list[Counter]:
    """Step-wise multisets of the samples all ranks consumed (a rank out of samples adds nothing)."""
    steps = max(len(r) for r in per_rank)
    return [Counter(i for rank in per_rank if s < len(rank) for i in rank[s]) for s in range(steps)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("topology")
    dp2, dp4 = str(base / "dp2"), str(base / "dp4")
    saved2 = run_ranks(save_job, 2, dp2)
    from_2 = [(k, f"{dp2}/{k}", k, GLOBAL_BATCH // 4, AFTER) for k in (*KINDS, "custom")]
    four = run_ranks(save_and_restore_job, 4, dp4, from_2)
    trn, back = str(base / "trn"), str(base / "back")
    for args in (
        ["convert", f"{dp4}/stateful", trn, "--to", "neuron", "--dp", "2", "--config", str(CONFIG)],
        ["convert", trn, back, "--to", "cuda"],
    ):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 0, r.output
    half = GLOBAL_BATCH // 2
    jobs: list[tuple[Any, ...]] = [
        (k, f"{dp4}/{k}", k, half, AFTER) for k in (*KINDS, "random", "hf_iterable", "custom")
    ]
    jobs[0] = (*jobs[0], f"{dp4}/run_same")
    jobs += [(f"{k}/small", f"{dp4}/{k}", k, half // 2, None) for k in KINDS]  # global batch 8 -> 4
    plain_small = next(i for i, job in enumerate(jobs) if job[0] == "plain/small")
    jobs[plain_small] = (*jobs[plain_small], f"{dp4}/run_small")
    jobs += [("trn", trn, "stateful", half, AFTER), ("back", back, "stateful", half, AFTER)]
    jobs += [("same", f"{dp2}/stateful", "stateful", half, AFTER)]
    two = run_ranks(restore_job, 2, jobs, f"{dp4}/mgr")
    ckpt.data.register(StridedAdapter())
    try:
        one = {k: _restore(f"{dp4}/{k}", k, GLOBAL_BATCH, AFTER, rank=0, world=1) for k in (*KINDS, "custom")}
    finally:
        ckpt.data.unregister("strided")
    return {
        "saved2": saved2,
        "saved4": [r["saved"] for r in four],
        "2to4": [r["restored"] for r in four],
        "4to2": two,
        "4to1": [one],
        "paths": {"dp4": dp4, "trn": trn, "back": back},
    }


def _after(saved: list[dict[str, Any]], kind: str) -> list[Counter]:
    return global_batches([r[kind]["after"] for r in saved])


def _got(restored: list[dict[str, Any]], label: str) -> list[Counter]:
    for r in restored:
        assert "refused" not in r[label], r[label]["refused"]
    return global_batches([r[label]["batches"] for r in restored])


# ------------------------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("kind", (*KINDS, "custom"))
@pytest.mark.parametrize("move", ["4to2", "4to1", "2to4"])
def test_same_global_batch_continues_the_uninterrupted_run(runs, move: str, kind: str) -> None:
    saved = runs["saved2"] if move == "2to4" else runs["saved4"]
    got = _got(runs[move], kind)
    assert got == _after(saved, kind), f"{kind}: {move}"
    assert {r[kind]["mode"] for r in runs[move]} == {"re-split"}


@pytest.mark.parametrize("move", ["4to2", "4to1", "2to4"])
def test_losses_continue_within_the_reduction_order(runs, move: str) -> None:
    """A linear model trained data-parallel (gradients summed over the ranks): after the resume on another DP size
    its losses are the uninterrupted run's up to the order of summation."""
    saved = runs["saved2"] if move == "2to4" else runs["saved4"]
    for k in (*[k for k in KINDS if k != "stateful"], "custom"):
        want = saved[0][k]["losses"]
        for r in runs[move]:
            assert r[k]["losses"] == pytest.approx(want, rel=1e-12, abs=1e-15), f"{k}: {move}"
            assert len(r[k]["losses"]) == AFTER


def test_manager_restore_latest_continues_on_another_dp_size(runs) -> None:
    """The report behind this feature: saved on 4 ranks, ``restore_latest`` on 2 restarted from step 0."""
    assert [(r["manager"]["step"], r["manager"]["mode"]) for r in runs["4to2"]] == [(SAVE_AT, "re-split")] * 2
    assert global_batches([r["manager"]["batches"] for r in runs["4to2"]]) == _after(runs["saved4"], "plain")


def test_through_convert_to_neuron_dp2_and_back(runs) -> None:
    want = _after(runs["saved4"], "stateful")
    for label in ("trn", "back"):
        assert _got(runs["4to2"], label) == want, label
    m = ckpt.open_checkpoint(runs["paths"]["trn"]).manifest
    assert (m.layout.dp, m.data_position["dp"], m.rng_base["dp"]) == (2, 4, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_changed_global_batch_exact_next_sample_no_repeat_or_skip(runs, kind: str) -> None:
    """Global batch 8 on 4 ranks -> 4 on 2 ranks: two new steps hold one old step's samples, and the rest of the
    epoch is exactly what the 4-rank epoch had left (DistributedSampler: its 72-item padded list minus the 24
    consumed; the HF split: the 70 rows minus the 24 consumed)."""
    got = _got(runs["4to2"], f"{kind}/small")
    want = _after(runs["saved4"], kind)
    for j in range(AFTER):
        assert got[2 * j] + got[2 * j + 1] == want[j], f"{kind}: old step {j}"
    consumed = sum(global_batches([r[kind]["before"] for r in runs["saved4"]]), Counter())
    epoch = Counter(range(N)) + Counter(_padding(4) if kind not in ("hf_split", "hf_stream") else [])
    assert consumed + sum(got, Counter()) == epoch


def _padding(world: int) -> list[int]:
    from ckpt.data.sampler import global_order

    order = global_order(
        {"dataset_len": N, "seed": SEED, "shuffle": True, "drop_last": False, "num_replicas": world}, 0
    )
    return order[N:]


def test_rng_carried_on_same_dp_size_rule_on_another(runs) -> None:
    same = runs["4to2"]
    for rank, r in enumerate(same):
        assert r["same"]["mode"] == "positioned"
        assert r["same"]["carried"] == ["python", "numpy", "torch"] and r["same"]["derived"] == []
        assert r["same"]["rng"] == runs["saved2"][rank]["rng_after_save"]
    for move in ("4to2", "2to4", "4to1"):
        for r in runs[move]:
            assert (r["stateful"]["carried"], r["stateful"]["derived"]) == (["python"], ["numpy", "torch"])
        # the shared python stream is one state everywhere; re-derived torch streams differ per rank
        assert len({r["stateful"]["rng"][0] for r in runs[move]}) == 1
        assert len({r["stateful"]["rng"][2] for r in runs[move]}) == len(runs[move])


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("random", "RandomSampler"),
        ("hf_iterable", "split the full dataset with ckpt.data.split_dataset_by_node"),
    ],
)
def test_loaders_ckpt_cannot_resplit_are_refused(runs, kind: str, needle: str) -> None:
    for r in runs["4to2"]:
        msg = r[kind]["refused"]
        assert "saved by 4 ranks, restoring on 2" in msg and needle in msg and "ckpt.data.register" in msg


def test_inspect_reports_the_position_and_the_rng_rule(runs) -> None:
    out = CliRunner().invoke(cli, ["inspect", f"{runs['paths']['dp4']}/stateful"]).output
    assert (
        "data position: epoch 0, next global sample 24 (distributed_sampler, 4 DP ranks, global batch 8"
        in out
    )
    assert "continues on any DP size" in out
    assert (
        "carried python (shared by every rank), re-derived numpy, torch from base seed 1234 (caller)" in out
    )


def test_manifest_records_the_global_position(runs) -> None:
    m = ckpt.open_checkpoint(f"{runs['paths']['dp4']}/stateful").manifest
    pos = m.data_position
    assert pos["adapter"] == "distributed_sampler" and pos["dp"] == 4 and pos["epoch"] == 0
    assert pos["samples"] == SAVE_AT * GLOBAL_BATCH and pos["per_rank"] == [SAVE_AT * 2] * 4
    assert pos["global_batch"] == GLOBAL_BATCH and pos["samples_total"] == SAVE_AT * GLOBAL_BATCH
    assert pos["order"] == {
        "kind": "distributed_sampler",
        "dataset_len": N,
        "seed": SEED,
        "shuffle": True,
        "drop_last": False,
        "num_replicas": 4,
    }
    assert m.rng_base == {
        "rule": "carry-or-derive/1",
        "seed": 1234,
        "source": "caller",
        "dp": 4,
        "shared": ["python"],
    }


@pytest.mark.parametrize("variant", ["same", "small"])
def test_verify_resume_checks_data_across_the_dp_change(runs, variant: str) -> None:
    """The ledgers of the 4-rank run and of its 2-rank resume (global batch 8, or 4): ``ckpt verify-resume`` compares
    the global sample digests (windows of equal sample counts when the batch changed) and names the RNG rule."""
    dp4 = runs["paths"]["dp4"]
    r = CliRunner().invoke(cli, ["verify-resume", f"{dp4}/run_{variant}", "--checkpoints", dp4, "--json"])
    doc = json.loads(r.output)
    checks = {c["check"]: c for c in doc["boundaries"][0]["checks"]}
    assert checks["data"]["status"] == "pass", checks["data"]
    assert "DP 4 -> 2" in checks["data"]["summary"] and checks["data"]["numbers"]["resumed_at"] == 24
    assert (
        checks["rng"]["numbers"]["carried"] == "python"
        and checks["rng"]["numbers"]["derived"] == "numpy, torch"
    )
