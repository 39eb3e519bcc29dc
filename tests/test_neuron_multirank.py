"""ckpt.neuron on 4 gloo processes holding a real NxD training tag's shards: save, and restore onto another DP size.

NxD's own layers and optimizer are the stand-in for Trainium in ``tests/test_neuron_nxd_real.py`` (TP partitions set
by NxD's layers, NxD's ``NeuronZero1Optimizer``, NxD's ``save_checkpoint`` and converter as the reference, and the
agreement of NxD's attributes with ckpt's rule set).  What only this file covers: the shards of a tag that NxD wrote
in a real training run (``fixtures/nxd/llama_gqa_h64``) saved from live ranks equal the import of that tag from disk,
and a TP2 x DP2 ZeRO-1 checkpoint restores onto DP=1.  The parameters here are plain tensors whose NxD TP attributes
are set from ckpt's ``nxd-llama`` rules, and the optimizer a minimal ZeRO-1 surface returning the tag's real state
dicts: this file tests the merging of those files, not where the attributes come from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from ckpt.converters import nxd
from conftest import run_ranks
from safetensors.torch import load_file

from ckpt.format.reader import CheckpointReader
from ckpt.layouts import LayoutSpec, bit_equal, nxd_to_full_state
from ckpt.safe_unpickle import load_torch_file

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"
TAG = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
TP = 2


class Holder(torch.nn.Module):
    """A module whose parameters have exactly the given dotted names and NxD TP attributes."""

    def __init__(self, tensors: dict[str, torch.Tensor], zero: bool = False) -> None:
        super().__init__()
        from ckpt.layouts.partition import nxd_partition

        for name, t in tensors.items():
            *path, leaf = name.split(".")
            mod: torch.nn.Module = self
            for p in path:
                if not hasattr(mod, p):
                    mod.add_module(p, torch.nn.Module())
                mod = getattr(mod, p)
            param = torch.nn.Parameter(torch.zeros_like(t) if zero else t.clone())
            part = nxd_partition(name)  # what NxD's parallel layers set at runtime
            param.tensor_model_parallel = part is not None
            param.partition_dim = part[0] if part else -1
            param.partition_stride = part[1] if part else 1
            mod.register_parameter(leaf, param)


class FakeZero1:
    """The surface of torch_xla's ZeroRedundancyOptimizer the checkpointer uses, with a real NxD state dict."""

    def __init__(self, model: torch.nn.Module, sd: dict[str, Any] | None, dp_rank: int, dp_size: int) -> None:
        self.base_optimizer = object()
        self.param_groups = [{"params": list(model.parameters()), "lr": 0.0}]
        self.local_rank, self.local_world_size = dp_rank, dp_size
        self.device = torch.device("cpu")
        self._sd = sd
        self.loaded: dict[str, Any] | None = None

    def get_shape_info(self) -> dict[int, torch.Size]:
        return {i: p.shape for i, p in enumerate(self.param_groups[0]["params"])}

    def state_dict(self) -> dict[str, Any]:
        if self._sd is not None:
            return self._sd
        n = len(self.param_groups[0]["params"])
        group = {"lr": 0.0, "params": list(range(n))}
        return {"state": {}, "param_groups": [group], "base_state": {}, "shape_info": self.get_shape_info()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded = sd


def _rank_files(tp: int, dp: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model = load_torch_file(TAG / "model" / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_00.pt")
    opt = load_torch_file(TAG / "optim" / f"dp_rank_{dp:02d}_tp_rank_{tp:02d}_pp_rank_00.pt")
    return model, opt


def save_job(rank: int, world: int, root: str) -> None:
    from ckpt.neuron import NeuronCheckpointer

    tp, dp = rank % TP, rank // TP
    tensors, zsd = _rank_files(tp, dp)
    model = Holder(tensors)
    opt = FakeZero1(model, zsd, dp, world // TP)
    sched = load_torch_file(TAG / "scheduler.pt")
    config = json.loads((FIX / "config.json").read_text())
    ck = NeuronCheckpointer(
        async_save=True, rule_set=None, tp_rank=tp, tp_size=TP, dp_rank=dp, dp_size=world // TP, config=config
    )
    fut = ck.save(f"{root}/step_00000003", step=3, model=model, optimizer=opt, scheduler=sched)
    with torch.no_grad():  # the loop goes on while the write runs; the checkpoint must not see this
        for p in model.parameters():
            p.add_(1.0)
    fut.result()
    ck.close()


def restore_job(rank: int, world: int, root: str) -> str:
    from ckpt.neuron import ParallelInfo, restore

    tp, dp = rank % TP, rank // TP
    dp_size = world // TP
    tensors, _ = _rank_files(tp, 0)
    model = Holder(tensors, zero=True)
    opt = FakeZero1(model, None, dp, dp_size)
    sched: dict[str, Any] = {}
    par = ParallelInfo(tp_rank=tp, tp_size=TP, dp_rank=dp, dp_size=dp_size)
    restore(f"{root}/step_00000003", model=model, optimizer=opt, scheduler=sched, parallel=par, rule_set=None)
    assert opt.loaded is not None
    result = {
        "model": {n: p.detach().clone() for n, p in model.named_parameters()},
        "base_state": opt.loaded["base_state"],
        "groups": opt.loaded["param_groups"],
        "sched": sched,
    }
    path = (
        f"{root}/restored_w{world}_r{rank}.pt"  # tensors through a file: the result queue cannot carry them
    )
    torch.save(result, path)
    return path


def test_tp2_dp2_save_merges_to_full_and_restores_every_shard(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    run_ranks(save_job, 4, root)
    reader = CheckpointReader(f"{root}/step_00000003")
    m = reader.manifest
    assert (m.layout.world_size, m.layout.tp, m.layout.dp, m.layout.zero_stage, m.layout.kind) == (
        4,
        2,
        2,
        1,
        "nxd",
    )
    q = m.tensors["model.layers.0.self_attn.qkv_proj.weight_q"]
    assert q.partition == {"dim": 0, "stride": 1, "tp": 2, "source": "attributes"}
    assert m.tensors["model.layers.0.mlp.gate_up_proj.weight"].partition["stride"] == 2
    assert len({f.rank for f in m.files.values()}) == 4  # every rank wrote its share (ZeRO rows, TP shards)
    config = json.loads((FIX / "config.json").read_text())
    assert m.extra["nxd"]["config"] == config and m.extra["nxd"]["qkv_linear"] is True
    spec = LayoutSpec.from_hf_config(config, tp=2, qkv_linear=True)
    full = nxd_to_full_state(nxd.rank_shards(reader), spec, verify_replicas=True)
    truth = load_file(FIX / "model.safetensors")
    assert sorted(full) == sorted(truth) and all(bit_equal(full[k], truth[k]) for k in truth)
    opt_truth = load_file(FIX / "optimizer_full.safetensors")
    shards = nxd.rank_shards(reader, roles=("optimizer_state",))
    for key in ("exp_avg", "exp_avg_sq"):
        per = {
            r: {n.split("/")[1]: t for n, t in sd.items() if n.endswith("/" + key)}
            for r, sd in shards.items()
        }
        got = nxd_to_full_state(per, spec)
        assert all(bit_equal(got[k], opt_truth[f"{k}.{key}"]) for k in got)
    # saved from live ranks == imported from the NxD tag on disk
    imported = nxd.import_tag(TAG, str(tmp_path / "imported"))
    other = CheckpointReader(str(tmp_path / "imported"))
    assert sorted(imported.tensors) == sorted(m.tensors)
    assert all(bit_equal(reader.read(n), other.read(n)) for n in m.tensors)

    # restore on the same layout: every rank gets exactly its NxD shard and its ZeRO-1 rows back
    out = [torch.load(p, weights_only=True) for p in run_ranks(restore_job, 4, root)]
    for rank, res in enumerate(out):
        tp, dp = rank % TP, rank // TP
        tensors, zsd = _rank_files(tp, dp)
        assert all(bit_equal(res["model"][n], t) for n, t in tensors.items())
        assert sorted(res["base_state"]) == sorted(zsd["base_state"])
        for pid, per in zsd["base_state"].items():
            assert all(bit_equal(res["base_state"][pid][k], v) for k, v in per.items())
        assert res["sched"] == load_torch_file(TAG / "scheduler.pt")
        assert res["groups"][0]["lr"] == zsd["param_groups"][0]["lr"]

    # restore onto DP=1 (2 ranks): each TP rank gets the whole (DP-merged) TP-local state
    out = [torch.load(p, weights_only=True) for p in run_ranks(restore_job, 2, root)]
    for tp, res in enumerate(out):
        merged = nxd.open_tag(TAG).optimizer((tp, 0, 0))
        names = list(merged["state"])
        for pid, name in enumerate(names):
            for k, v in merged["state"][name].items():
                assert bit_equal(res["base_state"][pid][k], v), (name, k)
