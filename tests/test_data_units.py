"""ckpt.data and the RNG rule in one process: the DistributedSampler order ckpt recomputes is torch's own (for any
size, shuffle, drop_last, epoch), resumed epochs hand over to the ordinary sampler, global digests are order-free
sums, positions and manifests refuse malformed members, refusals name the fix, inspect prints the position, and
verify-resume judges a DP change from global digests only."""

from __future__ import annotations

import json
import random
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckpt.cli.main import cli
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from manifest_schema import assert_valid
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import ckpt
from ckpt.data import DataPosition, RankPosition, combine_digests, sample_digest, track
from ckpt.data.epoch import EpochResume
from ckpt.data.sampler import ResumedDistributedSampler, global_order, rank_share, reposition
from ckpt.errors import ManifestError, StateMismatchError
from ckpt.format import treecodec
from ckpt.format.data_position import merge
from ckpt.format.manifest import Manifest, seal
from ckpt.resume.checks import Cause, Status
from ckpt.resume.facts import CheckpointFacts, facts_from_mapping
from ckpt.resume.ledger import LedgerWriter, digest_ids
from ckpt.resume.sources import load_run
from ckpt.resume.verify import verify_run
from ckpt.state import rng as rng_mod


def _spec(n: int, world: int, shuffle: bool, drop_last: bool, seed: int) -> dict:
    return {
        "kind": "distributed_sampler",
        "dataset_len": n,
        "seed": seed,
        "shuffle": shuffle,
        "drop_last": drop_last,
        "num_replicas": world,
    }


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    world=st.integers(1, 6),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 5),
    epoch=st.integers(0, 3),
)
def test_recomputed_order_is_distributed_samplers_own(n, world, shuffle, drop_last, seed, epoch) -> None:
    spec = _spec(n, world, shuffle, drop_last, seed)
    for r in range(world):
        s = DistributedSampler(range(n), world, r, shuffle=shuffle, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        assert rank_share(spec, epoch, 0, r, world, drop_last) == list(s)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    old=st.integers(1, 5),
    new=st.integers(1, 5),
    drop_last=st.booleans(),
    k=st.integers(0, 10),
)
def test_resplit_deals_out_exactly_the_rest(n, old, new, drop_last, k) -> None:
    """Whatever the sizes: the new ranks together hold the saved list's rest, padded/truncated only for the new size."""
    spec = _spec(n, old, True, False, 3)
    order = global_order(spec, 1)
    start = min(k * old, len(order))
    shares = [rank_share(spec, 1, start, r, new, drop_last) for r in range(new)]
    rest = order[start:]
    dealt = [shares[r][j] for j in range(len(shares[0])) for r in range(new)]
    assert len({len(x) for x in shares}) == 1
    if drop_last:
        assert dealt == rest[: len(rest) // new * new]
    else:
        assert dealt[: len(rest)] == rest and len(dealt) - len(rest) < new


def test_resumed_sampler_hands_over_to_the_ordinary_one_next_epoch() -> None:
    s = DistributedSampler(range(30), 2, 1, shuffle=True, seed=4)
    reposition(s, EpochResume(_spec(30, 3, True, False, 4), 2, 12, 0))
    assert isinstance(s, ResumedDistributedSampler) and s.epoch == 2
    assert list(s) == global_order(_spec(30, 3, True, False, 4), 2)[12:][1::2] and len(s) == 9
    s.set_epoch(3)
    plain = DistributedSampler(range(30), 2, 1, shuffle=True, seed=4)
    plain.set_epoch(3)
    assert list(s) == list(plain) and len(s) == len(plain)


def test_global_digest_is_an_order_free_sum() -> None:
    a, b = [3, 1, 4, 1, 5], [9, 2, 6]
    assert sample_digest(a) == sample_digest(list(reversed(a))) == sample_digest(torch.tensor(a))
    assert sample_digest(a) != sample_digest([3, 1, 4, 5])  # a multiset: the repeat counts
    assert combine_digests([sample_digest(a), sample_digest(b)]) == sample_digest(a + b)
    assert sample_digest(a).startswith("ms:") and len(sample_digest(a)) == 19
    with pytest.raises(ValueError, match="not a global sample digest"):
        combine_digests([digest_ids(a)])


def _saved(tmp_path: Path, seed: int = 7) -> tuple[str, Any]:
    """A one-rank checkpoint 3 batches into the epoch, and the iterator that continues uninterrupted."""
    ds = list(range(40))
    loader = StatefulDataLoader(
        ds, batch_size=4, sampler=DistributedSampler(ds, 1, 0, shuffle=True, seed=seed)
    )
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    path = str(tmp_path / "c")
    ckpt.save(path, step=3, model={"w": torch.ones(2)}, dataloader=loader, progress={"samples": 12})
    assert sum(len(b) for b in first) == 12
    return path, it


def test_single_rank_position_schema_inspect_and_positioned_restore(tmp_path: Path) -> None:
    path, rest = _saved(tmp_path)
    doc = assert_valid(path)
    assert doc["data_position"]["samples"] == 12 and doc["rng_base"]["source"] == "checkpoint"
    m = ckpt.open_checkpoint(path).manifest  # both members survive the reader
    assert (m.data_position, m.rng_base) == (doc["data_position"], doc["rng_base"])
    want = [int(x) for b in rest for x in b]  # the rest of the uninterrupted epoch
    ds = list(range(40))
    fresh = StatefulDataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 1, 0, shuffle=True, seed=7))
    res = ckpt.restore(path, model={"w": torch.zeros(2)}, dataloader=fresh)
    assert res.data.mode == "positioned" and [int(x) for b in fresh for x in b] == want
    out = CliRunner().invoke(cli, ["inspect", path]).output
    assert (
        "data position: epoch 0, next global sample 12 (distributed_sampler, 1 DP ranks, global batch 4"
        in out
    )
    assert "on another DP size: carried python, numpy, torch" in out  # one rank: every stream is "shared"


def test_a_sampler_built_differently_is_refused_naming_the_field(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)
    ds = list(range(40))
    other = StatefulDataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 1, 0, shuffle=True, seed=8))
    with pytest.raises(
        StateMismatchError, match=r"data_position.order.seed is 7, the live DistributedSampler has 8"
    ):
        ckpt.restore(path, dataloader=other, rng=False)


def test_a_plain_dataloader_is_refused_with_the_fix(tmp_path: Path) -> None:
    ds = list(range(10))
    plain = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, 1, 0))
    with pytest.raises(StateMismatchError, match=r"ckpt.data.track\(loader\)"):
        ckpt.save(str(tmp_path / "p"), step=1, model={"w": torch.ones(1)}, dataloader=plain)
    assert not (tmp_path / "p" / "manifest.json").exists()
    tracked = track(plain)
    next(iter(tracked))
    ckpt.save(str(tmp_path / "t"), step=1, model={"w": torch.ones(1)}, dataloader=tracked)
    assert ckpt.open_checkpoint(str(tmp_path / "t")).manifest.data_position["per_rank"] == [2]


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda p: p.update(per_rank=[1, -1]), "data_position.per_rank: expected a list of non-negative"),
        (lambda p: p.update(dp=3), "data_position.per_rank: 2 entries for dp=3"),
        (lambda p: p.update(prefix="yes"), "data_position.prefix: expected true or false"),
        (lambda p: p.pop("adapter"), "data_position.adapter"),
    ],
)
def test_a_malformed_data_position_is_refused(tmp_path: Path, edit, needle: str) -> None:
    pos = {
        "adapter": "distributed_sampler",
        "dp": 2,
        "epoch": 0,
        "samples": 8,
        "per_rank": [4, 4],
        "prefix": True,
    }
    DataPosition.from_json(dict(pos))
    path, _ = _saved(tmp_path)
    doc = json.loads((Path(path) / "manifest.json").read_text())
    doc["data_position"] = pos
    edit(pos)
    with pytest.raises(ManifestError, match=needle):
        Manifest.from_json(seal(doc))


def _records(seeds: list[int], shared_python: bool) -> dict:
    out = {}
    for rank, s in enumerate(seeds):
        random.seed(0 if shared_python else s)
        np.random.seed(s)
        torch.manual_seed(s)
        # the host streams only: with torch_xla imported earlier in the same pytest process, capture() also records
        # the XLA seed, which this test does not set per rank
        state = treecodec.decode(rng_mod.capture())
        out[str(rank)] = treecodec.encode({k: state[k] for k in ("python", "numpy", "torch")}, "rng")
    return out


def test_rng_rule_carries_on_the_same_size_and_re_derives_reproducibly_on_another() -> None:
    records = _records([1, 2, 3, 4], shared_python=True)
    base = rng_mod.base_record(records, 99)
    assert base["shared"] == ["python"] and base["dp"] == 4
    carried, derived = rng_mod.restore_across(records, base, 10, 2, 4)
    assert (carried, derived) == (["python", "numpy", "torch"], [])
    assert torch.equal(torch.get_rng_state(), treecodec.decode(records["2"])["torch"])  # rank 2's own stream
    draws = []
    for _ in range(2):
        carried, derived = rng_mod.restore_across(records, base, 10, 1, 2)
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(()))))
    assert (carried, derived) == (["python"], ["numpy", "torch"])
    assert draws[0] == draws[1]  # reproducible
    random.seed(0)
    assert draws[0][0] == random.random()  # the shared stream is the saved one
    rng_mod.restore_across(records, base, 10, 0, 2)
    assert float(torch.rand(())) != draws[0][2]  # rank 0's re-derived stream is not rank 1's
    rng_mod.restore_across(records, base, 11, 1, 2)
    assert float(torch.rand(())) != draws[0][2]  # nor the stream of another step


# ---------------------------------------------------------------------------------------------- verify-resume


def _ledger(run: Path, *, post_world: int, post_batch: int, start: int, global_digests: bool) -> Path:
    """A 4-rank run of global batch 16 saved at step 8 and crashed at 12; a resume on ``post_world`` ranks whose
    first sample is ``start`` (96 is right) and whose batch is ``post_batch``."""
    order = list(range(10_000))

    def digest(ids: list[int]) -> str:
        return sample_digest(ids) if global_digests else digest_ids(ids[:4])

    with LedgerWriter(run, world_size=4) as w:
        for s in range(1, 13):
            w.step(s, 1.0 / s, 1e-3, samples=16 * s, data_digest=digest(order[16 * (s - 1) : 16 * s]))
            if s == 8:
                w.save(8, "ckpt/step_8")
    with LedgerWriter(run, world_size=post_world) as w:
        w.restore(8, "ckpt/step_8", 1.0)
        for j in range(8):
            lo = start + post_batch * j
            w.step(
                9 + j,
                1.0 / (9 + j),
                1e-3,
                samples=128 + post_batch * (j + 1),
                data_digest=digest(order[lo : lo + post_batch]),
            )
    return run


FACTS = facts_from_mapping(
    {
        8: CheckpointFacts(
            8, dp=4, samples=128, rng_shared=("python",), rng_streams=("python", "numpy", "torch")
        )
    }
)


@pytest.mark.parametrize("batch", [16, 8])
def test_verify_resume_passes_a_continuous_dp_change(tmp_path: Path, batch: int) -> None:
    v = verify_run(
        load_run(_ledger(tmp_path, post_world=2, post_batch=batch, start=128, global_digests=True)),
        facts=FACTS,
    )
    data, rng = v.verdicts[0].check("data"), v.verdicts[0].check("rng")
    assert data.status is Status.PASS and "DP 4 -> 2" in data.summary, data.summary
    assert data.numbers["resumed_at"] == 128
    assert (
        rng.status is Status.SKIP
        and "carried: python; re-derived from the base seed, step and rank: numpy, torch" in rng.summary
    )


@pytest.mark.parametrize("batch", [16, 8])
def test_verify_resume_fails_a_data_restart_across_a_dp_change(tmp_path: Path, batch: int) -> None:
    v = verify_run(
        load_run(_ledger(tmp_path, post_world=2, post_batch=batch, start=0, global_digests=True)), facts=FACTS
    )
    data = v.verdicts[0].check("data")
    assert data.status is Status.FAIL and data.cause is Cause.DATA_POSITION_LOST, data.summary
    assert "differ from the pre-crash run" in data.summary


def test_verify_resume_skips_per_rank_digests_across_a_dp_change(tmp_path: Path) -> None:
    v = verify_run(
        load_run(_ledger(tmp_path, post_world=2, post_batch=16, start=128, global_digests=False)), facts=FACTS
    )
    data = v.verdicts[0].check("data")
    assert data.status is Status.SKIP and "ckpt.data.global_digest" in data.summary


def test_tp_peers_reading_one_replica_count_once() -> None:
    """4 processes, TP 2 x DP 2: processes 0,1 read replica 0 and 2,3 replica 1; the job is 2 DP ranks."""
    order = _spec(40, 2, True, False, 1)

    def pos(replica: int, consumed: int = 8) -> RankPosition:
        return RankPosition("distributed_sampler", 0, 0, consumed, 4, order, replica, 2)

    merged = merge([pos(0), pos(0), pos(1), pos(1)], {"samples": 16})
    assert merged is not None
    assert (merged.dp, merged.samples, merged.per_rank, merged.prefix) == (2, 16, (8, 8), True)
    assert merged.global_batch == 8 and merged.samples_total == 16
    torn = merge([pos(0), pos(0, 4), pos(1), pos(1)], {})
    assert torn is not None and torn.adapter == "mixed" and not torn.prefix


@pytest.mark.parametrize(("n", "world"), [(70, 4), (9, 2), (5, 5), (6, 4)])
def test_ckpt_split_has_the_rows_of_datasets_split(n: int, world: int) -> None:
    import datasets
    from datasets.distributed import split_dataset_by_node as hf_split

    from ckpt.data.hf_split import rank_rows

    full = datasets.Dataset.from_dict({"idx": list(range(n))})
    order = {"kind": "hf_split", "dataset_len": n, "num_replicas": world, "batch_size": 2}
    for r in range(world):
        want = [row["idx"] for row in hf_split(full, r, world)]
        mine = ckpt.data.split_dataset_by_node(full, r, world)
        assert [mine[i]["idx"] for i in range(len(mine))] == want
        assert rank_rows(order, 0, r, world, 2) == want  # the step-major order dealt back on the same layout


def test_position_counts_batches_handed_out_not_prefetched() -> None:
    """With worker processes prefetching, the position is still the batches the loop received."""
    ds = list(range(30))
    loader = StatefulDataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 1, 0), num_workers=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    assert ckpt.data.position_of(loader)["consumed"] == 12
    for _ in it:
        pass
    assert ckpt.data.position_of(loader)["consumed"] == 30


# ------------------------------------------------------------------------- HF IterableDataset split by examples


def _stream(n: int, shards: int, shuffle: int | None) -> Any:
    import datasets

    full = datasets.Dataset.from_dict({"idx": list(range(n))}).to_iterable_dataset(num_shards=shards)
    return full.shuffle(seed=shuffle, buffer_size=5) if shuffle is not None else full


def _rank_batches(loader: Any, steps: int | None) -> list[list[int]]:
    it = iter(loader)
    return [_idx(b) for b in (it if steps is None else islice(it, steps))]


def _idx(batch: Any) -> list[int]:
    return [int(x) for x in batch["idx"]]


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 30),
    shards=st.integers(1, 5),
    world=st.integers(1, 4),
    epoch=st.integers(0, 2),
    shuffle=st.sampled_from([None, 3]),
)
def test_ckpt_iterable_split_yields_datasets_examples_split(n, shards, world, epoch, shuffle) -> None:
    """Rank r of W yields exactly ``datasets.distributed.split_dataset_by_node(..., strategy="examples")``'s
    examples, in order, for any epoch, with and without a (seeded) buffer shuffle."""
    from datasets.distributed import split_dataset_by_node as hf_split

    shards = min(shards, n)
    for r in range(world):
        theirs = hf_split(_stream(n, shards, shuffle), r, world, strategy="examples")
        theirs.set_epoch(epoch)
        mine = ckpt.data.split_dataset_by_node(_stream(n, shards, shuffle), r, world)
        assert isinstance(mine, ckpt.data.SplitIterable)
        mine.set_epoch(epoch)
        assert [x["idx"] for x in mine] == [x["idx"] for x in theirs]


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(8, 40),
    shards=st.integers(1, 4),
    old=st.integers(1, 4),
    new=st.integers(1, 4),
    batch=st.integers(1, 3),
    steps=st.integers(0, 3),
    shuffle=st.sampled_from([None, 7]),
    epoch=st.integers(0, 1),
    tracked=st.booleans(),
)
def test_iterable_resplit_continues_the_stream_exactly(
    n, shards, old, new, batch, steps, shuffle, epoch, tracked
) -> None:
    """Saved on ``old`` ranks after ``steps`` steps of ``batch`` per rank, re-split on ``new`` ranks: dealt back in
    rank order the new ranks yield exactly the epoch's stream from the saved index (no example repeated or skipped),
    and where the global batch is unchanged every later global batch equals the uninterrupted run's as a multiset."""
    from ckpt.data.adapters import HfIterableAdapter

    def loader(rank: int, world: int, size: int) -> Any:
        split = ckpt.data.split_dataset_by_node(_stream(n, shards, shuffle), rank, world)
        split.set_epoch(epoch)
        return (
            track(DataLoader(split, batch_size=size))
            if tracked
            else StatefulDataLoader(split, batch_size=size)
        )

    steps = min(steps, n // (old * batch))  # a save mid-epoch, where every rank has taken the same count
    adapter = HfIterableAdapter()
    loaders = [loader(r, old, batch) for r in range(old)]
    iters = [iter(x) for x in loaders]
    before = [[_idx(next(it)) for _ in range(steps)] for it in iters]
    pos = merge([adapter.position(x) for x in loaders], {})
    assert pos is not None and pos.prefix and pos.samples == steps * batch * old and pos.epoch == epoch
    after = [[_idx(b) for b in it] for it in iters]  # the uninterrupted run

    new_batch = batch * old // new if batch * old % new == 0 else batch
    resumed = []
    for r in range(new):
        x = loader(r, new, new_batch)
        adapter.reposition(x, DataPosition.from_json(pos.to_json()), r, new, "test")
        resumed.append([i for b in _rank_batches(x, None) for i in b])
    full = _stream(n, shards, shuffle)
    full.set_epoch(epoch)
    stream = [x["idx"] for x in full]
    dealt = [resumed[k % new][k // new] for k in range(n - pos.samples)]
    assert dealt == stream[pos.samples :] and sum(map(len, resumed)) == n - pos.samples
    assert Counter(i for rank in before for b in rank for i in b) + Counter(dealt) == Counter(range(n))
    if new_batch * new == batch * old:
        steps_after = max(len(r) for r in after)
        want = [Counter(i for r in after if s < len(r) for i in r[s]) for s in range(steps_after)]
        chunks = [[r[s * new_batch : (s + 1) * new_batch] for s in range(steps_after)] for r in resumed]
        assert [Counter(i for r in chunks for i in r[s]) for s in range(steps_after)] == want


def test_iterable_position_is_refused_for_another_shuffle_seed(tmp_path: Path) -> None:
    """seed=None (or another seed) draws another stream: the saved index would point into it, so it is refused."""
    loader = StatefulDataLoader(ckpt.data.split_dataset_by_node(_stream(20, 2, 3), 0, 1), batch_size=2)
    next(iter(loader))
    path = str(tmp_path / "c")
    ckpt.save(path, step=1, model={"w": torch.ones(1)}, dataloader=loader)
    doc = assert_valid(path)
    assert doc["data_position"]["order"]["kind"] == "hf_iterable" and doc["data_position"]["samples"] == 2
    other = StatefulDataLoader(ckpt.data.split_dataset_by_node(_stream(20, 2, 4), 0, 1), batch_size=2)
    with pytest.raises(
        StateMismatchError, match=r"data_position.order.stream is .*shuffle with the same fixed seed"
    ):
        ckpt.restore(path, dataloader=other, rng=False)
    same = StatefulDataLoader(ckpt.data.split_dataset_by_node(_stream(20, 2, 3), 0, 1), batch_size=2)
    assert ckpt.restore(path, dataloader=same, rng=False).data.mode == "positioned"
    assert len([b for b in same]) == 9


def test_datasets_own_iterable_split_and_workers_are_refused() -> None:
    from datasets.distributed import split_dataset_by_node as hf_split

    with pytest.raises(
        StateMismatchError, match="already split by datasets.distributed.split_dataset_by_node"
    ):
        ckpt.data.split_dataset_by_node(hf_split(_stream(8, 2, None), 0, 2), 0, 2)
    worker = DataLoader(ckpt.data.split_dataset_by_node(_stream(8, 2, None), 0, 1), num_workers=1)
    with pytest.raises(
        StateMismatchError,
        match=r"read it in the main process \(num_workers=0\), not in DataLoader workers \(1\)",
    ):
        list(worker)
