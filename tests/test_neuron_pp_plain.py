"""TP2 x PP2 with a plain torch AdamW (no ZeRO-1) on 4 gloo processes: each PP stage restores exactly its own
parameters' optimizer state from the merged checkpoint, and a stage that does not match is refused.

The model is one stage's share of a toy network (plain tensors carrying NxD's TP attributes; which stage holds what
is ``extra.nxd.pp_ranks``, gathered by the saver); each rank's loss is local, so the uninterrupted run is the
reference for the resumed one: moments, step counts and hyperparameters bit-exact, the next losses equal.
The live NxD counterpart (ZeRO-1) is ``tests/test_neuron_nxd_real.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import run_ranks

TP, PP, SAVE_AT, STEPS = 2, 2, 2, 4
# per stage: name -> (full shape, TP partition dim or None for replicated)
STAGES: list[dict[str, tuple[tuple[int, ...], int | None]]] = [
    {"embed.weight": ((8, 4), 0), "layers.0.w": ((4, 6), 1), "layers.0.norm": ((4,), None)},
    {"layers.1.w": ((6, 4), 0), "layers.1.norm": ((4,), None), "lm_head.weight": ((8, 4), 0)},
]


def _seeded(name: str, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 31 + salt)
    return torch.randn(shape, generator=g)


class Stage(torch.nn.Module):
    """This rank's TP shard of one PP stage's parameters, with the NxD TP attributes NxD's layers would set."""

    def __init__(self, pp: int, tp: int, extra: str | None = None) -> None:
        super().__init__()
        specs = dict(STAGES[pp])
        if extra:  # first, so that the optimizer's groups are otherwise the saved ones
            specs = {extra: ((4,), None), **specs}
        self.targets: dict[str, torch.Tensor] = {}
        for name, (shape, dim) in specs.items():
            full, target = _seeded(name, shape, 0), _seeded(name, shape, 1)
            if dim is not None:
                full, target = full.chunk(TP, dim)[tp].clone(), target.chunk(TP, dim)[tp].clone()
            *path, leaf = name.split(".")
            mod: torch.nn.Module = self
            for p in path:
                if not hasattr(mod, p):
                    mod.add_module(p, torch.nn.Module())
                mod = getattr(mod, p)
            param = torch.nn.Parameter(full)
            param.tensor_model_parallel = dim is not None
            param.partition_dim = dim if dim is not None else -1
            param.partition_stride = 1
            mod.register_parameter(leaf, param)
            self.targets[name] = target

    def loss(self) -> torch.Tensor:
        params = dict(self.named_parameters())
        return sum(((params[n] - t) ** 2 * (1 + params[n].sin())).sum() for n, t in self.targets.items())


def _optimizer(model: Stage, groups: int = 2) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if groups == 1:
        return torch.optim.AdamW(params, lr=0.05, betas=(0.8, 0.95), weight_decay=0.1)
    return torch.optim.AdamW(
        [
            {"params": params[:-1], "weight_decay": 0.1},
            {"params": params[-1:], "weight_decay": 0.0, "lr": 0.02},
        ],
        lr=0.05,
        betas=(0.8, 0.95),
    )


def _step(model: Stage, opt: torch.optim.Optimizer) -> float:
    opt.zero_grad()
    loss = model.loss()
    loss.backward()
    opt.step()
    return loss.item()


def _host(model: Stage, opt: torch.optim.Optimizer) -> dict[str, Any]:
    sd = opt.state_dict()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "state": {i: {k: v.clone() for k, v in per.items()} for i, per in sd["state"].items()},
        "groups": sd["param_groups"],
    }


def rank_job(rank: int, world: int, root: str, mode: str) -> str:
    from ckpt.errors import StateMismatchError
    from ckpt.neuron import NeuronCheckpointer, ParallelInfo, restore

    tp, pp = rank % TP, rank // TP
    par = ParallelInfo(tp_rank=tp, tp_size=TP, pp_rank=pp, pp_size=PP)
    model = Stage(pp, tp)
    opt = _optimizer(model)
    ck_path = f"{root}/ckpt"
    out: dict[str, Any] = {"losses": {}}
    start = 0
    if mode == "resume":
        with torch.no_grad():  # a different state than the saved one: the restore must replace all of it
            for p in model.parameters():
                p.add_(0.5)
        restore(ck_path, model=model, optimizer=opt, parallel=par, rule_set=None)
        out["restored"] = _host(model, opt)
        start = SAVE_AT
        # refusals: a stage holding a parameter the checkpoint lacks, and another group structure
        refused = []
        for bad_model, groups in ((Stage(pp, tp, extra=f"stage{pp}.bias"), 2), (Stage(pp, tp), 1)):
            try:
                restore(ck_path, model=bad_model, optimizer=_optimizer(bad_model, groups), parallel=par,
                        rule_set=None, strict=False)  # fmt: skip
                refused.append("")
            except StateMismatchError as e:
                refused.append(str(e))
        out["refused"] = refused
    for step in range(start, STEPS):
        if mode == "first" and step == SAVE_AT:
            out["saved"] = _host(model, opt)
            ck = NeuronCheckpointer(rule_set=None, tp_rank=tp, tp_size=TP, pp_rank=pp, pp_size=PP)
            ck.save(ck_path, step=SAVE_AT, model=model, optimizer=opt).result()
            ck.close()
        out["losses"][step] = _step(model, opt)
    path = f"{root}/{mode}_r{rank}.pt"  # tensors through a file: the result queue cannot carry them
    torch.save(out, path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("pp_plain"))
    first = [torch.load(p, weights_only=True) for p in run_ranks(rank_job, TP * PP, root, "first")]
    resumed = [torch.load(p, weights_only=True) for p in run_ranks(rank_job, TP * PP, root, "resume")]
    return {"root": root, "first": first, "resumed": resumed}


def test_each_stage_restores_its_optimizer_state_bit_exact(runs: dict[str, Any]) -> None:
    from ckpt.format.reader import CheckpointReader
    from ckpt.layouts import bit_equal

    m = CheckpointReader(f"{runs['root']}/ckpt").manifest
    assert (m.layout.tp, m.layout.pp, m.layout.zero_stage) == (TP, PP, 0)
    assert m.optimizer is not None
    assert [g["params"] for g in m.optimizer["param_groups"]] == [
        ["embed.weight", "layers.0.w", "layers.1.w", "layers.1.norm"],
        ["layers.0.norm", "lm_head.weight"],
    ]  # the stages' records merged in stage order
    for rank in range(TP * PP):
        saved, got = runs["first"][rank]["saved"], runs["resumed"][rank]["restored"]
        assert sorted(got["params"]) == sorted(saved["params"])
        assert all(bit_equal(got["params"][n], t) for n, t in saved["params"].items()), rank
        assert sorted(got["state"]) == sorted(saved["state"]) and len(saved["state"]) == 3
        for i, per in saved["state"].items():
            assert sorted(got["state"][i]) == sorted(per) == ["exp_avg", "exp_avg_sq", "step"]
            assert all(bit_equal(got["state"][i][k], v) for k, v in per.items()), (rank, i)
        assert got["groups"] == saved["groups"], rank  # lr, betas, weight_decay, ... and the param ids
        resumed = runs["resumed"][rank]["losses"]
        assert resumed == {s: runs["first"][rank]["losses"][s] for s in range(SAVE_AT, STEPS)}, rank


def test_a_stage_that_does_not_match_is_refused(runs: dict[str, Any]) -> None:
    for rank in range(TP * PP):
        extra, groups = runs["resumed"][rank]["refused"]
        pp = rank // TP
        assert f"stage{pp}.bias" in extra and "\n" not in extra, (rank, extra)
        assert "param_groups" in groups and "\n" not in groups, (rank, groups)
