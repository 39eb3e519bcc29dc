"""ZeRO-1 padding: an NxD tag with dp=3 whose parameters do not divide by 3 (fixtures/nxd/llama_zero1_pad_dp3, made
by torch_xla's own ZeroRedundancyOptimizer, see its README) imports, exports and restores exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt.cli.main import cli
from ckpt.converters import nxd
from ckpt.converters.convert import load_config
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt import open_checkpoint
from ckpt.format import treecodec
from ckpt.layouts import bit_equal

ROOT = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_zero1_pad_dp3"
TAG = ROOT / "step_3"
MASTER_TAG = ROOT / "master_weights" / "step_3"  # same run, saved with sharded_master_weights
DP = 3


@pytest.fixture(scope="module")
def truth() -> tuple[dict, dict, dict]:
    return (
        load_file(ROOT / "model.safetensors"),
        load_file(ROOT / "optimizer_full.safetensors"),
        load_config(str(ROOT / "config.json")),
    )


@pytest.fixture(scope="module", params=[TAG, MASTER_TAG], ids=["moments", "master_weights"])
def cuda_ckpt(request, tmp_path_factory) -> tuple[Path, Path]:
    """``(NxD tag, ckpt convert of it to the CUDA layout)`` (the import under test)."""
    out = tmp_path_factory.mktemp("zero1pad") / "cuda"
    args = [
        "convert",
        str(request.param),
        str(out),
        "--from",
        "neuron",
        "--to",
        "cuda",
        "--config",
        str(ROOT / "config.json"),
    ]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    return request.param, out


@pytest.fixture(scope="module")
def neuron_ckpt(tmp_path_factory) -> dict[Path, Path]:
    """Both NxD tags imported keeping their layout (``nxd.manifest.import_tag``), for the live restores."""
    from ckpt.converters.nxd.manifest import import_tag

    out = {}
    for tag in (TAG, MASTER_TAG):
        out[tag] = tmp_path_factory.mktemp("zero1pad") / "neuron"
        import_tag(tag, str(out[tag]), config=load_config(str(ROOT / "config.json")))
    return out


def _raw_optim(tag: Path) -> list[dict]:
    return [
        torch.load(tag / "optim" / f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt", weights_only=False)
        for d in range(DP)
    ]


def test_fixture_has_padding() -> None:
    """The point of the fixture: some parameters are padded (their dim 0 does not divide by dp=3)."""
    sd = _raw_optim(TAG)[0]
    padded = [p for p, s in sd["shape_info"].items() if s[0] % DP]
    assert len(padded) >= 5
    for p in padded:
        rows = sd["shape_info"][p][0]
        assert sd["base_state"][p]["exp_avg"].shape[0] * DP > rows


def test_import_is_ground_truth(truth, cuda_ckpt: tuple[Path, Path]) -> None:
    """Model and optimizer moments equal the full-tensor AdamW run exactly: padding stripped, nothing shifted."""
    model, optim, _ = truth
    tag, cuda = cuda_ckpt
    r = open_checkpoint(str(cuda))
    m = r.manifest
    assert set(r.names("parameter")) == set(model)
    for name, t in model.items():
        assert bit_equal(r.read(name), t), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert bit_equal(r.read(f"optim/{name}/{key}"), optim[f"{name}.{key}"]), (name, key)
        assert bit_equal(treecodec.decode(m.optimizer["state"][name]["step"]), optim[f"{name}.step"])
        if tag == MASTER_TAG:  # fp32 training: the master weights are the weights
            assert bit_equal(r.read(f"optim/{name}/master_weight"), t), name
    if tag == TAG:
        assert not [n for n in r.manifest.tensors if n.endswith("/master_weight")]
    assert m.step == 3


def test_export_equals_nxd_shards(cuda_ckpt: tuple[Path, Path], tmp_path: Path) -> None:
    """cuda -> NxD tag dp=3: every optimizer shard (padding rows included) equals what torch_xla wrote."""
    tag, cuda = cuda_ckpt
    out = tmp_path / "nxd" / "step_3"
    args = [
        "convert",
        str(cuda),
        str(out),
        "--to",
        "neuron",
        "--format",
        "nxd",
        "--tp",
        "1",
        "--dp",
        str(DP),
    ]
    r = CliRunner().invoke(cli, [*args, "--qkv-linear"])
    assert r.exit_code == 0, r.output
    orig, new = _raw_optim(tag), _raw_optim(out)
    for d in range(DP):
        o, n = orig[d], new[d]
        assert set(n) == set(o), d
        for p, w in o.get("sharded_master_weights", {}).items():
            got = n["sharded_master_weights"][p]
            assert got.shape == w.shape and bit_equal(got, w), (d, p, "master")
        assert {p: list(s) for p, s in n["shape_info"].items()} == {
            p: list(s) for p, s in o["shape_info"].items()
        }
        assert set(n["base_state"]) == set(o["base_state"])
        for p, per in o["base_state"].items():
            assert set(n["base_state"][p]) == set(per)
            for k, v in per.items():
                assert n["base_state"][p][k].shape == v.shape, (d, p, k)
                assert bit_equal(n["base_state"][p][k], v), (d, p, k)
        names = [g.pop("param_names") for g in n["param_groups"]]  # ckpt adds pid -> name to NxD's groups
        assert n["param_groups"] == o["param_groups"]
    om = torch.load(tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    nm = torch.load(out / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    assert list(nm) == list(om) and all(bit_equal(nm[k], v) for k, v in om.items())
    assert names == [list(om)]  # one group, pids in NxD's model order
    assert nxd.read_tag(out).meta.dp_size == DP


def _module_from(named: dict[str, torch.Tensor], device: torch.device) -> torch.nn.Module:
    """A module whose parameters have exactly the NxD tag's names, in the file's order."""
    root = torch.nn.Module()
    for name, t in named.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t).to(device)))
    return root


@pytest.mark.parametrize("master", [False, True], ids=["moments", "master_weights"])
@pytest.mark.parametrize("dp_rank", range(DP))
def test_restore_into_live_zero1_is_exact(dp_rank: int, master: bool, neuron_ckpt, monkeypatch) -> None:
    """NxD tag -> ckpt (import_tag) -> ckpt.neuron.restore into torch_xla's ZeroRedundancyOptimizer on DP rank d of 3:
    the live optimizer's state_dict() equals NxD's file for that rank (padding rows included) and the model equals
    NxD's model file.  Only the rank identity is patched (``xr.global_ordinal``); restore uses no collectives, except
    the all-gather that torch_xla's ``load_state_dict`` runs after loading master weights into its shards, which
    cannot run in one process and is skipped (the shards it would gather are compared instead)."""
    import torch_xla
    import torch_xla.runtime as xr
    from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

    from ckpt.neuron import checkpointer as neuron
    from ckpt.neuron.parallel import ParallelInfo

    tag = MASTER_TAG if master else TAG
    monkeypatch.setattr(xr, "global_ordinal", lambda: dp_rank)
    monkeypatch.setattr(xr, "global_device_count", lambda: DP)
    if master:
        monkeypatch.setattr(
            ZeroRedundancyOptimizer, "allgather_weights_and_update_full_parameter", lambda *a: None
        )
    nxd_model = torch.load(tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    model = _module_from(nxd_model, torch_xla.device())
    assert [n for n, _ in model.named_parameters()] == list(nxd_model)
    opt = ZeroRedundancyOptimizer(
        [{"params": list(model.parameters())}],
        torch.optim.AdamW,
        grad_clipping=False,
        sharding_groups=[list(range(DP))],
        save_master_weights=master,
        lr=0.001,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.01,
    )
    assert (opt.local_rank, opt.local_world_size) == (dp_rank, DP)
    neuron.restore(
        str(neuron_ckpt[tag]),
        model=model,
        optimizer=opt,
        parallel=ParallelInfo(dp_rank=dp_rank, dp_size=DP),
    )
    for n, p in model.named_parameters():
        assert bit_equal(p.detach().cpu(), nxd_model[n]), n
    live = opt.state_dict()
    want = _raw_optim(tag)[dp_rank]
    assert set(live) == set(want)
    for p, w in want.get("sharded_master_weights", {}).items():
        got = live["sharded_master_weights"][p].detach().cpu()
        assert got.shape == w.shape and bit_equal(got, w), (p, "master")
    assert {p: list(s) for p, s in live["shape_info"].items()} == {
        p: list(s) for p, s in want["shape_info"].items()
    }
    assert set(live["base_state"]) == set(want["base_state"])
    for p, per in want["base_state"].items():
        for k, v in per.items():
            got = live["base_state"][p][k].detach().cpu()
            assert got.shape == v.shape and bit_equal(got, v), (p, k)
    g_live, g_want = live["param_groups"][0], want["param_groups"][0]
    assert g_live["params"] == g_want["params"] and g_live["lr"] == g_want["lr"]


@pytest.mark.parametrize("dp_rank", range(2))
def test_restore_onto_other_dp_size(dp_rank: int, neuron_ckpt, monkeypatch) -> None:
    """The dp=3 tag restored into a dp=2 ZeroRedundancyOptimizer: each rank holds torch_xla's own
    ``_shard_tensor`` of the full state (full = NxD's dp=3 shards gathered and cut as torch_xla's all-gather does)."""
    import torch_xla
    import torch_xla.runtime as xr
    from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

    from ckpt.neuron import checkpointer as neuron
    from ckpt.neuron.parallel import ParallelInfo

    monkeypatch.setattr(xr, "global_ordinal", lambda: dp_rank)
    monkeypatch.setattr(xr, "global_device_count", lambda: 2)
    nxd_model = torch.load(TAG / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    model = _module_from(nxd_model, torch_xla.device())
    opt = ZeroRedundancyOptimizer(
        [{"params": list(model.parameters())}],
        torch.optim.AdamW,
        grad_clipping=False,
        sharding_groups=[[0, 1]],
    )
    neuron.restore(
        str(neuron_ckpt[TAG]), model=model, optimizer=opt, parallel=ParallelInfo(dp_rank=dp_rank, dp_size=2)
    )
    nxd3 = _raw_optim(TAG)
    live = opt.state_dict()
    for p, rows in ((p, s[0]) for p, s in nxd3[0]["shape_info"].items()):
        for k in ("exp_avg", "exp_avg_sq"):
            full = torch.cat([d["base_state"][p][k] for d in nxd3])[:rows]
            want = opt._shard_tensor(full)
            got = live["base_state"][p][k].detach().cpu()
            assert got.shape == want.shape and bit_equal(got, want), (p, k)


def test_xser_export_round_trip_is_ground_truth(truth, cuda_ckpt: tuple[Path, Path], tmp_path: Path) -> None:
    """cuda -> NxD xser tag dp=3 (padded shards in ``.tensors`` files) -> cuda: still the ground truth."""
    model, optim, _ = truth
    tag, cuda = cuda_ckpt
    out = tmp_path / "nxd" / "step_3"
    args = ["convert", str(cuda), str(out), "--to", "neuron", "--format", "nxd", "--tp", "1", "--dp", str(DP)]
    r = CliRunner().invoke(cli, [*args, "--qkv-linear", "--xser"])
    assert r.exit_code == 0, r.output
    assert (out / "optim" / "dp_rank_02_tp_rank_00_pp_rank_00.pt.tensors").is_dir()
    back = tmp_path / "cuda"
    args = ["convert", str(out), str(back), "--to", "cuda", "--config", str(ROOT / "config.json")]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    rd = open_checkpoint(str(back))
    for name, t in model.items():
        assert bit_equal(rd.read(name), t), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert bit_equal(rd.read(f"optim/{name}/{key}"), optim[f"{name}.{key}"]), (name, key)
        if tag == MASTER_TAG:
            assert bit_equal(rd.read(f"optim/{name}/master_weight"), t), name
