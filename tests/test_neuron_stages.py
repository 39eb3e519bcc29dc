"""PP stages' optimizer records merge into one (``ckpt/neuron/stages.py``); a stage restores only its own tensors.

The live proof (NxD's own layers and ``NeuronZero1Optimizer``, TP2 x PP2, restore bit-exact) is
``tests/test_neuron_nxd_real.py``; these are the rules on their own, including the refusal.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ckpt.errors import StateMismatchError
from ckpt.neuron import ParallelInfo
from ckpt.neuron.stages import merge_stage_optimizers, stage_tensors


def record(params: list[str], lr: float = 0.1, steps: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "type": "torch.optim.adamw.AdamW",
        "param_groups": [{"lr": lr, "params": params}],
        "state": {p: {"step": s} for p, s in (steps or {}).items()},
    }


def test_stage_records_merge_in_stage_order() -> None:
    a = record(["embed", "layers.0.w"], steps={"embed": 3, "layers.0.w": 3})
    b = record(["layers.1.w", "lm_head"], steps={"layers.1.w": 3, "lm_head": 3})
    merged = merge_stage_optimizers([(1, b), (0, a), (1, b), (0, a)])  # every rank's record, in rank order
    assert merged["param_groups"] == [{"lr": 0.1, "params": ["embed", "layers.0.w", "layers.1.w", "lm_head"]}]
    assert sorted(merged["state"]) == ["embed", "layers.0.w", "layers.1.w", "lm_head"]
    assert merged["type"] == a["type"]


def test_stages_with_different_hyperparameters_are_refused() -> None:
    with pytest.raises(StateMismatchError, match="PP stage 1's optimizer differs"):
        merge_stage_optimizers([(0, record(["a"])), (1, record(["b"], lr=0.2))])


def test_stage_tensors_from_pp_ranks() -> None:
    m = SimpleNamespace(extra={"nxd": {"pp_ranks": {"embed": [0], "tied": [0, 1], "lm_head": [1]}}})
    assert stage_tensors(m, ParallelInfo(pp_rank=1, pp_size=2)) == {"tied", "lm_head"}
    assert stage_tensors(m, ParallelInfo()) is None  # no PP: the whole checkpoint is this rank's
    assert stage_tensors(SimpleNamespace(extra={}), ParallelInfo(pp_rank=0, pp_size=2)) is None
