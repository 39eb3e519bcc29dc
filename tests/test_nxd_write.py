"""converters.nxd writing: round trips (plain, xser, DP re-shard with padding and master weights), NxD byte layout,
atomic commit, and ZeRO-1 shard/merge properties."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest
import torch
from ckpt.converters import nxd
from ckpt.converters.nxd.zero1 import merge_zero1_optimizer, shard_zero1_optimizer
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.errors import CheckpointExistsError
from ckpt.safe_unpickle import load_torch_file

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"
PLAIN = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
XSER = FIX / "nxd_train_tp2_dp2_zero1_xser" / "step_3"


@pytest.fixture(scope="module")
def tag() -> nxd.NxdTag:
    return nxd.read_tag(PLAIN)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def _same_content(a: nxd.NxdTag, b: nxd.NxdTag) -> None:
    assert _equal(a.per_rank_model, b.per_rank_model)
    assert _equal(a.per_rank_optimizer, b.per_rank_optimizer)
    assert a.scheduler == b.scheduler and a.user_content == b.user_content


def _files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}


def _pickle_bytes(p: Path) -> bytes:
    z = zipfile.ZipFile(p)
    return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


@pytest.mark.parametrize("xser", [False, True], ids=["plain", "xser"])
def test_round_trip_matches_nxd_layout(tmp_path: Path, tag: nxd.NxdTag, xser: bool) -> None:
    out = nxd.write_tag(tag, tmp_path, "step_3", xser=xser)
    ref = XSER if xser else PLAIN
    assert _files(out) == _files(
        ref
    )  # same names: markers, model/, optim/ (+ .tensors, .info.pt), scheduler, user
    back = nxd.read_tag(out)
    assert back.meta.status is nxd.TagStatus.COMPLETE and back.meta.xser is xser and back.meta.dp_size == 2
    _same_content(tag, back)
    # the pickled structures are what NxD wrote, byte for byte (TensorReference global, tids, shape_info lists)
    rel = "model/dp_rank_00_tp_rank_01_pp_rank_00.pt"
    if xser:
        assert _pickle_bytes(out / rel) == _pickle_bytes(ref / rel)
        assert _pickle_bytes(out / (rel + ".info.pt")) == _pickle_bytes(ref / (rel + ".info.pt"))
    else:
        assert _equal(torch.load(out / rel, weights_only=True), torch.load(ref / rel, weights_only=True))
    # optimizer files: NxD's structure plus param_names in each group (pid -> name, so no reader has to guess)
    rel = "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt"
    got, want = load_torch_file(out / rel), load_torch_file(ref / rel)
    names = [g.pop("param_names") for g in got["param_groups"]]
    assert names == [list(tag.per_rank_model[(0, 0, 0)])]  # one group: NxD's model order
    if xser:
        assert {k: v.tid for k, v in got["base_state"][3].items() if k != "step"} == {
            k: v.tid for k, v in want["base_state"][3].items() if k != "step"
        }
        got["base_state"], want["base_state"] = {}, {}
        assert _pickle_bytes(out / (rel + ".info.pt")) == _pickle_bytes(ref / (rel + ".info.pt"))
    assert _equal(got, want)
    assert (
        b"torch_xla.utils.serialization\nTensorReference"
        in _pickle_bytes(out / "model/dp_rank_00_tp_rank_00_pp_rank_00.pt")
        or not xser
    )


def test_done_is_last_and_no_temp_left(tmp_path: Path, tag: nxd.NxdTag) -> None:
    out = nxd.write_tag(tag, tmp_path, "step_3", xser=True)
    done = (out / "done").stat().st_mtime_ns
    assert all(p.stat().st_mtime_ns <= done for p in out.rglob("*") if p.is_file())
    assert [p.name for p in tmp_path.iterdir()] == ["step_3"]
    with pytest.raises(CheckpointExistsError):
        nxd.write_tag(tag, tmp_path, "step_3")
    nxd.write_tag(tag, tmp_path, "step_3", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["step_3"]


@pytest.mark.parametrize("xser", [False, True], ids=["plain", "xser"])
def test_reshard_dp3_with_padding_and_master_weights(tmp_path: Path, tag: nxd.NxdTag, xser: bool) -> None:
    opts = {}
    for rank, opt in tag.per_rank_optimizer.items():
        master = {n: (t.double() + 1) for n, t in tag.per_rank_model[rank].items()}  # float64 masters happen
        opts[rank] = {**opt, "master_weights": master}
    with_master = nxd.NxdTag(tag.meta, tag.per_rank_model, opts, tag.scheduler, tag.user_content)
    out = nxd.write_tag(with_master, tmp_path, "step_4", xser=xser, dp_size=3)
    assert (
        len(
            [
                p
                for p in (out / "optim").iterdir()
                if re.fullmatch(r"dp_rank_\d+_tp_rank_\d+_pp_rank_\d+\.pt", p.name)
            ]
        )
        == 6
    )
    back = nxd.read_tag(out)
    assert back.meta.dp_size == 3
    _same_content(with_master, back)
    # raw shard: embed_tokens (128 rows) padded to 129, 43 rows per DP rank, last row of rank 2 zero
    raw = nxd.open_tag(out)
    d2 = torch.load(raw.files.optim[(2, (0, 0, 0))], weights_only=True) if not xser else None
    if d2 is not None:
        assert d2["shape_info"][0] == [128, 64]
        assert d2["base_state"][0]["exp_avg"].shape == (43, 64)
        assert torch.count_nonzero(d2["base_state"][0]["exp_avg"][-1]) == 0
        assert d2["sharded_master_weights"][0].dtype == torch.float64


def test_model_from_master_weights_when_tensors_left_out(tmp_path: Path, tag: nxd.NxdTag) -> None:
    """NxD's avoid_saving_lower_precision_weights: model .tensors/ empty, weights only in master shards."""
    rank = (0, 0, 0)
    opts = {
        r: {**o, "master_weights": {n: t.clone() for n, t in tag.per_rank_model[r].items()}}
        for r, o in tag.per_rank_optimizer.items()
    }
    t2 = nxd.NxdTag(tag.meta, tag.per_rank_model, opts, tag.scheduler, tag.user_content)
    out = nxd.write_tag(t2, tmp_path, "step_5", xser=True)
    for f in (out / "model").glob("*.tensors/tensor_*.pt"):
        f.unlink()
    assert nxd.tag_status(out).status is nxd.TagStatus.COMPLETE and not nxd.tag_status(out).problems
    got = nxd.open_tag(out).model(rank)
    assert _equal(got, tag.per_rank_model[rank])


def test_two_param_groups_weight_decay_split(tmp_path: Path, tag: nxd.NxdTag) -> None:
    """NxD examples group params as [no 'bias'/'norm' in name] + [the rest]; pid order follows the groups."""
    opts = {}
    for rank, opt in tag.per_rank_optimizer.items():
        names = list(tag.per_rank_model[rank])
        decay = [n for n in names if "norm" not in n and "bias" not in n]
        no_decay = [n for n in names if n not in decay]
        g = {k: v for k, v in opt["param_groups"][0].items() if k != "params"}
        groups = [{**g, "params": decay}, {**g, "weight_decay": 0.0, "params": no_decay}]
        state = {n: opt["state"][n] for n in decay + no_decay}  # the reader yields state in pid order
        opts[rank] = {**opt, "state": state, "param_groups": groups}
    t2 = nxd.NxdTag(tag.meta, tag.per_rank_model, opts, tag.scheduler, tag.user_content)
    out = nxd.write_tag(t2, tmp_path, "step_6")
    raw = torch.load(out / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    assert raw["shape_info"][len(decay)] == [64]  # first no-decay pid is a norm
    back = nxd.read_tag(out)
    _same_content(t2, back)


def test_plain_optimizer_round_trip(tmp_path: Path, tag: nxd.NxdTag) -> None:
    out = nxd.write_tag(tag, tmp_path, "step_7", zero1=False)
    assert sorted(p.name for p in (out / "optim").iterdir()) == [
        "dp_rank_00_tp_rank_00_pp_rank_00.pt",
        "dp_rank_00_tp_rank_01_pp_rank_00.pt",
    ]
    back = nxd.read_tag(out)
    assert not back.meta.zero1
    _same_content(tag, back)


shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, dp=st.integers(1, 7), seed=st.integers(0, 2**16))
def test_shard_merge_round_trip(shape: tuple[int, ...], dp: int, seed: int) -> None:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    shards = nxd.shard_zero1(t, dp)
    assert len(shards) == dp and all(s.shape == shards[0].shape for s in shards)
    assert shards[0].shape[0] * dp - shape[0] < dp  # padding is less than one row per rank
    assert torch.equal(nxd.merge_zero1(shards, shape), t)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    dp=st.integers(1, 5),
    dp2=st.integers(1, 5),
    master=st.booleans(),
)
def test_optimizer_shard_merge_round_trip(rows: list[int], dp: int, dp2: int, master: bool) -> None:
    names = [f"p{i}" for i in range(len(rows))]
    shapes_ = {n: (r, 3) for n, r in zip(names, rows, strict=True)}
    merged = {
        "state": {
            n: {"step": torch.tensor(2.0), "exp_avg": torch.randn(s), "exp_avg_sq": torch.rand(s)}
            for n, s in shapes_.items()
        },
        "param_groups": [{"lr": 0.1, "params": names}],
        "master_weights": {n: torch.randn(s, dtype=torch.float64) for n, s in shapes_.items()}
        if master
        else None,
        "extra": {},
    }
    dicts = shard_zero1_optimizer(merged, shapes_, dp)
    assert [sorted(d["base_state"]) for d in dicts] == [list(range(len(names)))] * dp
    again = merge_zero1_optimizer(dicts, names, where="test")
    assert _equal(again, merged)
    # re-shard to another DP size and back
    assert _equal(
        merge_zero1_optimizer(shard_zero1_optimizer(again, shapes_, dp2), names, where="test"), merged
    )
