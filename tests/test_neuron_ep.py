"""The Neuron saver places expert-parallel shards: 4 gloo ranks as NxD TP=2 x EP=2 (EP carved out of DP=2) holding a
tiny Mixtral's NxD rank tensors (stacked experts ``[E/ep, H, 2I/tp]``, NxD's ``expert_model_parallel`` marks).  The
manifest records EP (``layout.ep``, ``partition.ep``), the logical expert tensors hold every expert once, and a
restore on the same layout gives every rank its exact shard back, and ``ckpt convert`` turns it into the HF tensors it
was made from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_ranks
from safetensors.torch import load_file

from ckpt.format.reader import CheckpointReader
from ckpt.layouts import LayoutSpec
from ckpt.layouts.experts import full_state_to_nxd_ep
from ckpt.layouts.names import EXPERT_STACKED
from ckpt.layouts.partition import nxd_partition

transformers = pytest.importorskip("transformers")
TP, EP = 2, 2
CONFIG = {
    "model_type": "mixtral", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 32, "intermediate_size": 8, "num_local_experts": 4,
    "num_experts_per_tok": 2, "max_position_embeddings": 32,
}  # fmt: skip


def rank_tensors(root: str, tp: int, ep: int) -> dict[str, torch.Tensor]:
    state = load_file(f"{root}/hf/model.safetensors")
    spec = LayoutSpec.from_hf_config(CONFIG, tp=TP, ep=EP)
    return full_state_to_nxd_ep(state, spec)[(tp, 0, ep)]


def holder(tensors: dict[str, torch.Tensor], zero: bool = False) -> torch.nn.Module:
    """A module with exactly these parameter names and the attributes NxD's layers set on them."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        param = torch.nn.Parameter(torch.zeros_like(t) if zero else t.clone())
        part = nxd_partition(name, "nxd-mixtral")
        param.tensor_model_parallel = part is not None
        param.partition_dim = part[0] if part else -1
        param.partition_stride = part[1] if part else 1
        if EXPERT_STACKED.match(name):
            param.expert_model_parallel = True  # ExpertFusedLinear._mark_expert_parallel_weights (ep > 1)
        mod.register_parameter(leaf, param)
    return root


def save_restore_job(rank: int, world: int, root: str) -> bool:
    """Save this rank's shard, then (after every rank's save) restore it into zeros; True if it came back exact."""
    import torch.distributed as dist

    from ckpt.neuron import NeuronCheckpointer, ParallelInfo, restore

    tp, ep = rank % TP, rank // TP
    want = rank_tensors(root, tp, ep)
    ck = NeuronCheckpointer(
        tp_rank=tp, tp_size=TP, dp_rank=ep, dp_size=EP, ep_rank=ep, ep_size=EP, config=CONFIG
    )  # fmt: skip
    ck.save(f"{root}/step_00000001", step=1, model=holder(want)).result()
    ck.close()
    dist.barrier()
    model = holder(want, zero=True)
    par = ParallelInfo(tp_rank=tp, tp_size=TP, dp_rank=ep, dp_size=EP, ep_rank=ep, ep_size=EP)
    restore(f"{root}/step_00000001", model=model, parallel=par, config=CONFIG)
    got = dict(model.named_parameters())
    return all(torch.equal(got[n].detach(), t) for n, t in want.items())


def test_tp2_ep2_save_records_ep_and_restores_every_shard(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CONFIG))
    hf.save_pretrained(tmp_path / "hf")
    root = str(tmp_path)
    assert all(run_ranks(save_restore_job, TP * EP, root))
    reader = CheckpointReader(f"{root}/step_00000001")
    m = reader.manifest
    assert (m.layout.tp, m.layout.ep, m.layout.kind) == (TP, EP, "nxd")
    nxd = m.extra["nxd"]
    assert nxd["rule_set"] == "nxd-mixtral" and nxd["config"]["model_type"] == "mixtral"
    gu = "model.layers.1.mlp.expert_mlps.mlp_op.gate_up_proj.weight"
    entry = reader.entry(gu)
    assert list(entry.shape) == [4, 16, 16]  # E, H, 2I: every expert once, both TP halves
    assert entry.partition == {"dim": 2, "stride": 2, "tp": TP, "source": "attributes", "ep": EP}
    full = reader.read(gu)
    for tp in range(TP):
        for ep in range(EP):
            local = rank_tensors(root, tp, ep)[gu]
            assert torch.equal(full[ep * 2 : (ep + 1) * 2, :, tp * 8 : (tp + 1) * 8], local)
    router = "model.layers.0.mlp.router.linear_router.weight"
    assert reader.entry(router).partition is None and list(reader.entry(router).shape) == [4, 16]
    json.dumps(nxd)
    # the saver's EP checkpoint converts (streaming) to the very HF tensors it was made from
    from ckpt.converters.convert import convert
    from ckpt.converters.options import ConvertOptions

    convert(f"{root}/step_00000001", f"{root}/back", ConvertOptions(to="cuda", format="hf"))
    want = load_file(f"{root}/hf/model.safetensors")
    got = {}
    for f in sorted(Path(f"{root}/back").glob("*.safetensors")):
        got |= load_file(str(f))
    assert got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items())
