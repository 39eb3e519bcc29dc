"""ckpt.neuron against NxD 2.29's own code: its parallel layers set the TP attributes, its ``NeuronZero1Optimizer``
holds the optimizer state, its ``save_checkpoint`` and ``checkpoint_converter`` are the reference.

Four gloo processes on the XLA CPU device (``tests/_nxd_real.py``; NxD unmodified from ``tests/vendor/``, stand-ins in
``tests/nxd_shim/``), two layouts: TP2 x DP2 with ZeRO-1 and TP2 x PP2.  One run trains 4 steps, saving after step 2
with :class:`NeuronCheckpointer` *and* with NxD's ``save_checkpoint`` (same live state); a second run in fresh
processes restores the ckpt checkpoint and trains steps 3-4.  Proven:

* the saved manifest's TP partitions are what NxD's layers set (``source: attributes``), with the layout sizes;
* ckpt's HF export of that manifest equals, tensor for tensor, NxD's ``checkpoint_converter --convert_to_full_state``
  run on NxD's own tag of the same state;
* the restore gives every rank bit-exactly its parameters, ZeRO-1 moment shards and master-weight shards back, and
  the losses after the restore equal the uninterrupted run's exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_ranks

pytest.importorskip("torch_xla", reason="NxD's NeuronZero1Optimizer needs torch_xla (PJRT_DEVICE=CPU)")

LAYOUTS = {"tp2_dp2_zero1": (2, 1), "tp2_pp2": (2, 2)}  # name: (tp, pp); dp = 4 / (tp * pp)
SAVE_AT, STEPS = 2, 4


def _rank_run(rank: int, world: int, nxd_src: str, root: str, mode: str) -> dict[str, Any]:
    """Every layout in turn in this process: ``first`` trains all steps saving at SAVE_AT, ``resume`` restores."""
    import _nxd_real as R

    from ckpt.neuron import NeuronCheckpointer, restore

    out: dict[str, Any] = {}
    for name, (tp, pp) in LAYOUTS.items():
        ps = R.nxd_env(nxd_src, tp, pp)
        model = R.build(ps)
        opt = R.make_optimizer(ps, model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        base = Path(root) / name
        losses: dict[int, float | None] = {}
        start = 0
        if mode == "resume":
            with torch.no_grad():  # a different state than the saved one: the restore must replace all of it
                for p in model.parameters():
                    p.add_(0.5)
            restore(str(base / "ckpt"), model=model, optimizer=opt, scheduler=sched, config=R.CONFIG)
            torch.save(R.host_state(model, opt), base / f"restored_r{rank}.pt")
            start = SAVE_AT
        for step in range(start, STEPS):
            if mode == "first" and step == SAVE_AT:
                torch.save(R.host_state(model, opt), base / f"saved_r{rank}.pt")
                ck = NeuronCheckpointer(config=R.CONFIG)  # ranks and sizes from NxD's parallel_state
                ck.save(
                    str(base / "ckpt"), step=SAVE_AT, model=model, optimizer=opt, scheduler=sched
                ).result()
                ck.close()
                from neuronx_distributed.trainer import checkpoint as nxd_checkpoint

                nxd_checkpoint.save_checkpoint(
                    str(base / "nxd"), f"step_{SAVE_AT}", model=model, optimizer=opt, scheduler=sched,
                    user_content={"step": SAVE_AT},
                )  # fmt: skip
            losses[step] = R.train_step(ps, model, opt, step, sched)
        out[name] = losses
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def runs(nxd_src: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("nxd_real")
    for name in LAYOUTS:
        (root / name).mkdir()
    first = run_ranks(_rank_run, 4, nxd_src, str(root), "first", timeout=600)
    resumed = run_ranks(_rank_run, 4, nxd_src, str(root), "resume", timeout=600)
    return {"root": root, "first": first, "resumed": resumed, "nxd_src": nxd_src}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_manifest_partitions_come_from_nxd_layers(runs: dict[str, Any], name: str) -> None:
    from ckpt.reader import CheckpointReader

    tp, pp = LAYOUTS[name]
    m = CheckpointReader(str(runs["root"] / name / "ckpt")).manifest
    assert (m.layout.kind, m.layout.tp, m.layout.pp, m.layout.dp, m.layout.zero_stage) == (
        "nxd", tp, pp, 4 // (tp * pp), 1,
    )  # fmt: skip
    expect = {
        "model.embed_tokens.weight": (0, 1), "model.layers.0.self_attn.qkv_proj.weight_q": (0, 1),
        "model.layers.1.self_attn.qkv_proj.weight_k": (0, 1), "model.layers.0.self_attn.o_proj.weight": (1, 1),
        "model.layers.1.mlp.gate_up_proj.weight": (0, 2), "model.layers.0.mlp.down_proj.weight": (1, 1),
        "lm_head.weight": (0, 1),
    }  # fmt: skip
    for n, (dim, stride) in expect.items():
        assert m.tensors[n].partition == {"dim": dim, "stride": stride, "tp": tp, "source": "attributes"}, n
    assert m.tensors["model.norm.weight"].partition is None
    assert m.tensors["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 48, 32)
    assert m.extra["nxd"]["qkv_linear"] is True


def _nxd_full_state(runs: dict[str, Any], name: str, out: Path) -> dict[str, torch.Tensor]:
    """NxD's own converter (``examples/training/llama/convert_checkpoints.py``, i.e. ``checkpoint_converter``) on
    NxD's own tag, in a subprocess with the shim: ``--convert_to_full_state``."""
    import _nxd_real as R

    tp, pp = LAYOUTS[name]
    src = runs["nxd_src"]
    out.mkdir(parents=True)
    config = out / "config.json"
    R.config_json(config)
    env = dict(os.environ, NXD_SRC=src, NXD_CPU_MODE="1", PYTHONPATH=os.pathsep.join([R.SHIM, src]))
    script = Path(src).parent / "examples" / "training" / "llama" / "convert_checkpoints.py"
    cmd = [
        sys.executable, str(script), "--convert_to_full_state", "--input_dir",
        str(runs["root"] / name / "nxd" / f"step_{SAVE_AT}" / "model"), "--output_dir", str(out),
        "--config", str(config), "--tp_size", str(tp), "--pp_size", str(pp), "--qkv_linear", "1",
        "--kv_size_multiplier", "1", "--hw_backend", "trn1", "--n_layers", str(R.LAYERS),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "checkpoint.pt", weights_only=True)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hf_export_equals_nxd_converter_on_nxd_tag(runs: dict[str, Any], name: str, tmp_path: Path) -> None:
    import _nxd_real as R
    from ckpt.converters.convert import ConvertOptions, convert
    from safetensors.torch import load_file

    from ckpt.layouts import bit_equal

    theirs = _nxd_full_state(runs, name, tmp_path / "nxd_full")
    convert(
        str(runs["root"] / name / "ckpt"),
        str(tmp_path / "hf"),
        ConvertOptions(to="cuda", format="hf", config=R.CONFIG),
    )
    ours: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        ours |= load_file(f)
    assert sorted(ours) == sorted(theirs)
    assert len(ours) == 2 + 1 + 9 * R.LAYERS
    diff = [
        k
        for k in ours
        if not bit_equal(ours[k], theirs[k].to(ours[k].dtype)) or ours[k].dtype != theirs[k].dtype
    ]
    assert diff == []
    # and the saved weights are the trained ones, not the initial ones
    assert not torch.equal(
        ours["model.layers.0.mlp.down_proj.weight"], R.full_weights()["model.layers.0.mlp.down_proj.weight"]
    )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_restore_bit_exact_and_losses_continue(runs: dict[str, Any], name: str) -> None:
    base = runs["root"] / name
    for rank in range(4):
        saved = torch.load(base / f"saved_r{rank}.pt", weights_only=True)
        restored = torch.load(base / f"restored_r{rank}.pt", weights_only=True)
        assert sorted(restored) == sorted(saved)
        assert any(k.startswith("optim/") for k in saved) and any(k.startswith("master/") for k in saved)
        bad = [
            k for k in saved if saved[k].dtype != restored[k].dtype or not torch.equal(saved[k], restored[k])
        ]
        assert bad == [], (rank, bad[:5])
    for rank in range(4):
        first, resumed = runs["first"][rank][name], runs["resumed"][rank][name]
        assert sorted(resumed) == list(range(SAVE_AT, STEPS))
        assert {s: first[s] for s in resumed} == resumed, rank
    last = [r for r in runs["first"] if r[name][STEPS - 1] is not None]
    assert last and all(isinstance(r[name][STEPS - 1], float) for r in last)
