"""NxD's live objects, not re-implementations (issue 35, item 6).

* ``NeuronEPZero1Optimizer`` (NxD 2.29 ``optimizer/zero_redundancy_optimizer.py``), run on 4 gloo processes on the
  XLA CPU device (tp 1, ep 2, dp 4: expert-DP 2), one AdamW step: ckpt's reading of its live ``state_dict()`` files
  (``zero1_ep.merge``) puts every shard where the step put it, ckpt's writing (``zero1_ep.shard``) gives back each
  DP rank's live dict exactly, and a fresh live optimizer loads ckpt's dict to the same state.  This stands beside
  ``tests/test_nxd_moe.py``'s ``ep_zero1_tag``, which builds those dicts from NxD's code read by hand.
* NxD's ``XLARNGStatesTracker`` (``parallel_layers/random.py``), seeded by ``model_parallel_xla_manual_seed``:
  ckpt's capture (``ckpt.state.rng``, through ``ckpt.neuron.rng``) holds exactly its ``get_states()`` and seeds,
  encoded as the manifest encodes them, and a restore makes its ``fork()`` draw the same numbers again.  This stands
  beside ``tests/test_neuron_rng.py``, whose tracker is a stub with the same API.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_xla")


def same(a, b) -> bool:
    """Equal values and types, dict keys in the same order (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(v, b[k]) for k, v in a.items())
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(same, a, b))
    return a == b


@pytest.fixture(scope="module")
def ep_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from _ep_zero1_ranks import run
    from ranks import run_ranks

    return run_ranks(run, 4, str(tmp_path_factory.mktemp("ep_zero1")))


def test_live_ep_zero1_rank_layout_is_the_one_ckpt_assumes(ep_ranks) -> None:
    """NxD's rank layout: DP rank d is EP rank d mod ep and expert-DP rank d div ep (zero1_ep's docstring)."""
    assert [(r["dp"], r["ep"], r["edp"]) for r in ep_ranks] == [(d, d % 2, d // 2) for d in range(4)]
    live = ep_ranks[0]["live"]
    assert live["ep_param_group_offset"] == 1 and live["ep_base_state_offset"] == 3  # 3 non-expert pids


def test_ckpt_reads_the_live_ep_zero1_state_where_the_step_put_it(ep_ranks) -> None:
    """After one AdamW step, exp_avg = (1 - beta1) * the reduced gradient: ckpt's merged moments of every parameter
    are one constant times the gradient each rank set (every element distinct), non-expert over the 4 DP files,
    each EP rank's experts over its own expert-DP files."""
    from _ep_zero1_ranks import EXPERT, SHAPES, grad

    ratios = {}
    for r in ep_ranks[:2]:  # DP ranks 0 and 1: EP ranks 0 and 1
        state = r["named"]["state"]
        assert sorted(state) == sorted(SHAPES)
        for name in SHAPES:
            m, g = state[name]["exp_avg"], grad(name, r["ep"])
            assert m.shape == g.shape, name
            ratio = float(m.flatten()[0] / g.flatten()[0])
            assert torch.allclose(m, ratio * g, rtol=1e-5, atol=0), (name, r["ep"])
            ratios.setdefault(name in EXPERT, set()).add(round(ratio, 6))
    assert all(len(v) == 1 for v in ratios.values()), ratios  # one scale per optimizer: nothing mixed up


def test_ckpt_writes_each_live_ep_zero1_dict_back_and_nxd_loads_it(ep_ranks) -> None:
    for r in ep_ranks:
        assert same(r["written"], r["live"]), r["dp"]
        assert same(r["reloaded"], r["live"]), r["dp"]


def test_live_nxd_rng_tracker_round_trips_through_ckpt(tmp_path) -> None:
    from _one_rank import one_rank
    from neuronx_distributed.parallel_layers import random as nxd_random

    import ckpt.neuron  # noqa: F401  (registers the XLA stream)
    from ckpt.format import treecodec
    from ckpt.state import rng

    with one_rank():
        import torch_xla

        nxd_random.model_parallel_xla_manual_seed(1234)
        tracker = nxd_random.get_xla_rng_tracker()
        assert type(tracker).__module__ == "neuronx_distributed.parallel_layers.random"
        saved = rng.capture()  # the encoded tree the manifest keeps
        captured = treecodec.decode(saved)
        assert set(captured["xla_nxd_tracker"]) == set(tracker.get_states()) == {"model-parallel-rng"}
        assert torch.equal(
            captured["xla_nxd_tracker"]["model-parallel-rng"], tracker.get_states()["model-parallel-rng"]
        )
        assert captured["xla_nxd_tracker_seeds"] == sorted(tracker.seeds_) == [1234 + 2718]
        with tracker.fork():
            first = torch.rand(5)
        device_first = torch.rand(3, device=torch_xla.device()).cpu()
        nxd_random.model_parallel_xla_manual_seed(99)  # a later run re-seeds: other states, other seeds
        assert tracker.seeds_ == {99 + 2718}
        done = rng.restore(saved)
        assert "xla_nxd_tracker" in done
        assert tracker.seeds_ == {1234 + 2718}
        with tracker.fork():
            again = torch.rand(5)
        assert torch.equal(first, again)
        assert torch.equal(torch.rand(3, device=torch_xla.device()).cpu(), device_first)
        with pytest.raises(Exception, match="already exists"):  # NxD refuses a seed the restored tracker used
            tracker.add("another", 1234 + 2718)
