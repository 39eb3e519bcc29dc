"""ckpt.neuron against NxD 2.29's own code: its parallel layers set the TP attributes, its ``NeuronZero1Optimizer``
holds the optimizer state, its ``save_checkpoint`` and ``checkpoint_converter`` are the reference.

Four gloo processes on the XLA CPU device (``tests/_nxd_real.py``; NxD unmodified from ``tests/vendor/``, stand-ins in
``tests/nxd_shim/``), three layouts: TP2 x DP2 with ZeRO-1, TP2 x PP2, and TP2 x DP2 with one KV head replicated by
NxD's ``GQAQKVColumnParallelLinear`` (``kv_size_multiplier=2``).  One run trains 4 steps, saving after step 2
with :class:`NeuronCheckpointer` *and* with NxD's ``save_checkpoint`` (same live state); a second run in fresh
processes restores the ckpt checkpoint and trains steps 3-4.  Proven:

* the saved manifest's TP partitions are what NxD's layers set (``source: attributes``), with the layout sizes;
* where ckpt falls back to its ``nxd-llama`` rules (parameters without attributes), the rules place every shard as
  NxD's layers do;
* ckpt's HF export of that manifest equals, tensor for tensor, NxD's ``checkpoint_converter --convert_to_full_state``
  (run by rank 0, where NxD is already imported) on NxD's own tag of the same state;
* the restore gives every rank bit-exactly its parameters, ZeRO-1 moment shards and master-weight shards back, and
  the losses after the restore equal the uninterrupted run's exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_ranks

pytest.importorskip("torch_xla", reason="NxD's NeuronZero1Optimizer needs torch_xla (PJRT_DEVICE=CPU)")
pytest.importorskip("tenacity", reason="NxD's save_checkpoint imports it (a dev extra in pyproject.toml)")

# name: (tp, pp, KV heads, kv_size_multiplier); dp = 4 / (tp * pp).  The last one: one KV head replicated on both TP
# ranks by NxD's GQAQKVColumnParallelLinear (trn1 order), what NxD's converter handles (tp == kv * multiplier).
LAYOUTS = {"tp2_dp2_zero1": (2, 1, 2, 1), "tp2_pp2": (2, 2, 2, 1), "tp2_dp2_mqa_kvx2": (2, 1, 1, 2)}
SAVE_AT, STEPS = 2, 4


def _rank_run(rank: int, world: int, nxd_src: str, root: str, mode: str) -> dict[str, Any]:
    """Every layout in turn in this process: ``first`` trains all steps saving at SAVE_AT, ``resume`` restores."""
    import _nxd_real as R

    from ckpt.neuron import NeuronCheckpointer, restore

    out: dict[str, Any] = {}
    for name, (tp, pp, kv, mult) in LAYOUTS.items():
        ps = R.nxd_env(nxd_src, tp, pp)
        model = R.build(ps, kv, mult)
        cfg = R.config(kv)
        opt = R.make_optimizer(ps, model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        if mode == "first":
            out[f"{name}:rules"] = _rules_disagree(model)
        base = Path(root) / name
        losses: dict[int, float | None] = {}
        start = 0
        if mode == "resume":
            with torch.no_grad():  # a different state than the saved one: the restore must replace all of it
                for p in model.parameters():
                    p.add_(0.5)
            restore(str(base / "ckpt"), model=model, optimizer=opt, scheduler=sched, config=cfg)
            torch.save(R.host_state(model, opt), base / f"restored_r{rank}.pt")
            start = SAVE_AT
        for step in range(start, STEPS):
            if mode == "first" and step == SAVE_AT:
                torch.save(R.host_state(model, opt), base / f"saved_r{rank}.pt")
                ck = NeuronCheckpointer(
                    config=cfg, kv_size_multiplier=mult
                )  # ranks, sizes: NxD's parallel_state
                ck.save(
                    str(base / "ckpt"), step=SAVE_AT, model=model, optimizer=opt, scheduler=sched
                ).result()
                ck.close()
                from neuronx_distributed.trainer import checkpoint as nxd_checkpoint

                nxd_checkpoint.save_checkpoint(
                    str(base / "nxd"), f"step_{SAVE_AT}", model=model, optimizer=opt, scheduler=sched,
                    user_content={"step": SAVE_AT},
                )  # fmt: skip
                if rank == 0:  # NxD is imported here already: its converter runs here, not in another process
                    _nxd_convert_to_full(nxd_src, base, tp, pp, kv, mult)
            losses[step] = R.train_step(ps, model, opt, step, sched, kv, mult)
        out[name] = losses
        ps.destroy_model_parallel()
        # NxD's destroy_model_parallel keeps the KV-shared group (one process, one training); the next layout of this
        # process may replicate KV differently, so its group is cleared here as a fresh process would have it
        ps._KV_SHARED_GROUP = ps._KV_SHARED_GROUP_SPMD = ps._KV_SHARED_GROUP_SIZE = None
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
    from ckpt.format.reader import CheckpointReader

    tp, pp, _, mult = LAYOUTS[name]
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
    assert m.extra["nxd"]["qkv_linear"] is True and m.extra["nxd"]["kv_size_multiplier"] == mult


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_nxd_layer_attributes_agree_with_ckpt_rules(runs: dict[str, Any], name: str) -> None:
    """Where ckpt falls back to its rule set (parameters without NxD attributes), it places shards as NxD's layers do."""
    for rank in range(4):
        assert runs["first"][rank][f"{name}:rules"] == [], rank


def _nxd_convert_to_full(nxd_src: str, base: Path, tp: int, pp: int, kv: int, mult: int) -> None:
    """NxD's own converter command line (``examples/training/llama/convert_checkpoints.py``, i.e.
    ``checkpoint_converter``) on NxD's own tag: ``--convert_to_full_state``, output ``base/nxd_full/checkpoint.pt``."""
    import runpy

    import _nxd_real as R

    out = base / "nxd_full"
    out.mkdir()
    R.config_json(out / "config.json", kv)
    argv = [
        "convert_checkpoints.py", "--convert_to_full_state", "--input_dir", str(base / "nxd" / f"step_{SAVE_AT}" / "model"),
        "--output_dir", str(out), "--config", str(out / "config.json"), "--tp_size", str(tp), "--pp_size", str(pp),
        "--qkv_linear", "1", "--kv_size_multiplier", str(mult), "--hw_backend", "trn1", "--n_layers", str(R.LAYERS),
    ]  # fmt: skip
    saved, sys.argv = sys.argv, argv
    try:
        runpy.run_path(
            str(Path(nxd_src).parent / "examples/training/llama/convert_checkpoints.py"), run_name="__main__"
        )
    finally:
        sys.argv = saved


def _rules_disagree(model: torch.nn.Module) -> list[str]:
    """Parameters where the layout from NxD's attributes differs from ckpt's ``nxd-llama`` rules for the same name."""
    from ckpt.neuron import NxdLayout, ParallelInfo
    from ckpt.state.training import model_tensors

    par = ParallelInfo.detect()
    by_attr, by_rule = NxdLayout(model, par, rule_set=None), NxdLayout(torch.nn.Module(), par)
    bad = []
    for nt in model_tensors(model):
        a, r = by_attr(nt), by_rule(nt)
        if (a is None) != (r is None) or (
            a is not None
            and (a[:2] != r[:2] or (a[3]["dim"], a[3]["stride"]) != (r[3]["dim"], r[3]["stride"]))
        ):
            bad.append(nt.name)
    return bad


@pytest.mark.filterwarnings("ignore:not written to")  # an HF folder holds no optimizer state: expected
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hf_export_equals_nxd_converter_on_nxd_tag(runs: dict[str, Any], name: str, tmp_path: Path) -> None:
    import _nxd_real as R
    from ckpt.converters.convert import ConvertOptions, convert
    from safetensors.torch import load_file

    from ckpt.layouts import bit_equal

    theirs = torch.load(runs["root"] / name / "nxd_full" / "checkpoint.pt", weights_only=True)
    convert(
        str(runs["root"] / name / "ckpt"),
        str(tmp_path / "hf"),
        ConvertOptions(to="cuda", format="hf", config=R.config(LAYOUTS[name][2])),
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
        ours["model.layers.0.mlp.down_proj.weight"],
        R.full_weights(LAYOUTS[name][2])["model.layers.0.mlp.down_proj.weight"],
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


def test_vendored_archive_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed archive is a changed reference: extraction refuses it (and extracts nothing)."""
    import nxd_vendor

    if not nxd_vendor.ARCHIVE.is_file():
        pytest.skip(f"NxD source archive {nxd_vendor.ARCHIVE} is absent")
    data = bytearray(nxd_vendor.ARCHIVE.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "nxd.tar.xz"
    bad.write_bytes(bytes(data))
    monkeypatch.setattr(nxd_vendor, "ARCHIVE", bad)
    with pytest.raises(AssertionError, match="sha256"):
        nxd_vendor.extract(tmp_path / "out")
    assert not (tmp_path / "out").exists()
