"""ckpt.neuron with the real torch-xla on the CPU (PJRT_DEVICE=CPU): a tiny Llama trained on the XLA device with
torch_xla's ZeroRedundancyOptimizer, saved asynchronously, restored in a new process, continues bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt.format.reader import CheckpointReader

pytest.importorskip("torch_xla")
pytest.importorskip("transformers")
pytestmark = pytest.mark.xla

SCRIPT = Path(__file__).with_name("_neuron_xla_train.py")


def _run(*args: str) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=400
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-2000:] + p.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_xla_async_save_restore_in_new_process_continues_bitwise(tmp_path: Path) -> None:
    full = _run("full", str(tmp_path / "unused"))
    first = _run("first", str(tmp_path / "run"))
    resumed = _run("resume", str(tmp_path / "run"))
    # the save fetched every tensor in one device->host transfer
    assert first["transfers_in_save"] == 1
    assert resumed["restored"] == 3
    # XLA on the CPU is deterministic: the resumed run reproduces the uninterrupted losses exactly (float repr)
    assert first["losses"] + resumed["losses"] == full["losses"]
    assert resumed["params"] == full["params"]

    m = CheckpointReader(str(tmp_path / "run" / "step_00000003")).manifest
    assert m.backend == "neuron" and m.layout.kind == "nxd" and m.layout.zero_stage == 1
    assert (m.layout.tp, m.layout.pp, m.layout.dp) == (1, 1, 1)
    nxd = m.extra["nxd"]
    assert nxd["rule_set"] == "nxd-llama" and nxd["config"]["hidden_size"] == 32
    q = m.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.partition == {"dim": 0, "stride": 1, "tp": 1, "source": "nxd-llama"}
    assert m.tensors["model.layers.0.input_layernorm.weight"].partition is None
    assert "optim/model.layers.0.mlp.down_proj.weight/master_weight" in m.tensors
    assert m.tensors["optim/model.layers.0.mlp.down_proj.weight/exp_avg"].partition["dim"] == 1
    assert m.optimizer["type"].endswith("ZeroRedundancyOptimizer")
    assert "xla_seed" in json.dumps(m.rng["0"])
