"""NxD Training's loading of ckpt's ``--format nxdt`` tag: what its ``NLPCheckpointIO.load_checkpoint`` runs
(``_nxdt_load_ranks.py``; NxD Training's Lightning module itself does not import here, README.md) on 4 gloo ranks
(TP 2 x DP 2, ZeRO-1), on ckpt's tag and on NxD's own tag of the same state, gives the same model and optimizer
dicts on every rank, tensor for tensor, and user content with the Lightning counters NxD Training restores.

Source: ``fixtures/nxdt/llama_gqa_h64`` (NxD's own ``save_checkpoint`` output under an NxD Training tag name, with
Lightning's dict; fixtures/nxdt/README.md), converted to our manifest and back to an NxD Training tag by ckpt.
"""

from __future__ import annotations

import conftest
import pytest
import torch
from _nxd_launch import run_ranks
from ckpt.cli.main import cli
from click.testing import CliRunner

NAME = "llama_gqa_h64--step=3-consumed_samples=12.0.ckpt"
FIXTURE = conftest.ROOT / "fixtures" / "nxdt" / "llama_gqa_h64" / "checkpoints" / NAME
CONFIG = conftest.ROOT / "fixtures" / "nxd" / "llama_gqa_h64" / "config.json"
RANKS = 4


def _flat(v, prefix: str = "") -> dict:
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            out |= _flat(x, f"{prefix}{k}/")
        return out
    if isinstance(v, (list, tuple)):
        return _flat(dict(enumerate(v)), prefix)
    return {prefix.rstrip("/"): v}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    tmp = tmp_path_factory.mktemp("nxdt_load")
    ours = tmp / "exp" / "checkpoints" / NAME
    for args in (
        [str(FIXTURE), str(tmp / "ck"), "--to", "cuda", "--format", "ckpt", "--config", str(CONFIG)],
        [str(tmp / "ck"), str(ours), "--to", "neuron", "--format", "nxdt", "--tp", "2", "--dp", "2"],
    ):
        res = CliRunner().invoke(cli, ["convert", *args])
        assert res.exit_code == 0, res.output
    (tmp / "out").mkdir()
    run_ranks(
        "_nxdt_load_ranks.py", dict(tp=2, tags=[str(ours), str(FIXTURE)], out=str(tmp / "out")), tmp, RANKS
    )
    read = [
        [torch.load(tmp / "out" / f"{i}_rank{r}.pt", weights_only=False) for r in range(RANKS)]
        for i in (0, 1)
    ]
    return read[0], read[1]


@pytest.mark.parametrize("part", ["model", "optimizer"])
def test_nxdt_loader_gets_nxds_own_dicts_from_our_tag(loaded, part: str) -> None:
    """Equal to NxD's own, except that ckpt's optimizer param groups also carry torch's optional ``param_names``
    (which torch's ``Optimizer.load_state_dict`` documents as not affecting loading): the tag's model names."""
    ours, theirs = loaded
    for r in range(RANKS):
        a, b = _flat(ours[r][part]), _flat(theirs[r][part])
        names = {k: a.pop(k) for k in [k for k in a if "/param_names/" in k]}
        assert set(names.values()) <= set(ours[r]["model"]) and (bool(names) == (part == "optimizer")), (
            f"rank {r}"
        )
        assert sorted(a) == sorted(b), f"rank {r}"
        for k in a:
            if isinstance(b[k], torch.Tensor):
                assert torch.equal(a[k], b[k]), f"rank {r}: {part} {k}"
            else:
                assert a[k] == b[k], f"rank {r}: {part} {k}"


def test_nxdt_loader_user_content(loaded) -> None:
    ours, theirs = loaded
    for r in range(RANKS):
        u, t = ours[r]["user_content"], theirs[r]["user_content"]
        assert (u["global_step"], u["epoch"]) == (t["global_step"], t["epoch"]) == (3, 0)
        assert _flat(u["lr_schedulers"]) == _flat(t["lr_schedulers"])
