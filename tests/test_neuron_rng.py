"""XLA seed and NxD RNG tracker capture/restore (real torch_xla on the CPU; NxD's tracker is a faithful stub of
``neuronx_distributed.parallel_layers.random`` since NxD cannot be installed), in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch_xla")

CODE = r"""
import sys, types, torch
# stand-in for neuronx_distributed.parallel_layers.random: same API and state kind (torch.get_rng_state() tensors)
class Tracker:
    def __init__(self): self.states_, self.seeds_ = {}, set()
    def get_states(self): return dict(self.states_)
    def set_states(self, states): self.states_ = states
    def add(self, name, seed):
        orig = torch.get_rng_state(); torch.manual_seed(seed); self.states_[name] = torch.get_rng_state()
        self.seeds_.add(seed); torch.set_rng_state(orig)
T = Tracker()
rnd = types.ModuleType("neuronx_distributed.parallel_layers.random"); rnd.get_xla_rng_tracker = lambda: T
pl = types.ModuleType("neuronx_distributed.parallel_layers"); pl.random = rnd
nd = types.ModuleType("neuronx_distributed"); nd.parallel_layers = pl
sys.modules.update({"neuronx_distributed": nd, "neuronx_distributed.parallel_layers": pl,
                    "neuronx_distributed.parallel_layers.random": rnd})
import torch_xla, torch_xla.core.xla_model as xm
from ckpt.state import rng
T.add("model-parallel-rng", 2718 + 1)
xm.set_rng_state(77)
dev = torch_xla.device()
saved = rng.capture()
a = torch.rand(4, device=dev).cpu()
orig = torch.get_rng_state(); torch.set_rng_state(T.states_["model-parallel-rng"]); ta = torch.rand(3)
T.states_["model-parallel-rng"] = torch.get_rng_state(); torch.set_rng_state(orig)
done = rng.restore(saved)
assert done[-2:] == ["xla", "xla_nxd_tracker"], done
b = torch.rand(4, device=dev).cpu()
torch.set_rng_state(T.states_["model-parallel-rng"]); tb = torch.rand(3)
assert torch.equal(a, b) and torch.equal(ta, tb) and T.seeds_ == {2719}
print("ok")
"""


def test_xla_seed_and_nxd_tracker_round_trip() -> None:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
