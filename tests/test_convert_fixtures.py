"""Every NxD fixture converts to its ground truth exactly: weights, optimizer moments and steps, scheduler, user
content; and back to the Neuron layout it came from (our manifest and NxD-native), bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt.converters import nxd
from ckpt.converters.convert import ConvertOptions, convert, load_config
from safetensors.torch import load_file

from ckpt import open_checkpoint
from ckpt.format import treecodec
from ckpt.layouts import bit_equal

ROOT = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"
TAGS = {
    "nxd_train_tp2_dp2_zero1_plain/step_3": dict(qkv_linear=True, tp=2, dp=2),
    "nxd_train_tp2_dp2_zero1_xser/step_3": dict(qkv_linear=True, tp=2, dp=2),
    "nxd_from_full_tp2_pp2": dict(tp=2, pp=2),
    "nxd_from_full_tp2_qkvlinear": dict(qkv_linear=True, tp=2),
}


@pytest.fixture(scope="module")
def truth() -> tuple[dict, dict, dict]:
    return (
        load_file(ROOT / "model.safetensors"),
        load_file(ROOT / "optimizer_full.safetensors"),
        load_config(str(ROOT / "config.json")),
    )


@pytest.mark.parametrize("tag", sorted(TAGS))
def test_fixture_to_cuda_is_ground_truth(tag: str, truth, tmp_path: Path) -> None:
    model, optim, cfg = truth
    dst = tmp_path / "cuda"
    convert(str(ROOT / tag), str(dst), ConvertOptions(to="cuda", from_="neuron", config=cfg))
    r = open_checkpoint(str(dst))
    m = r.manifest
    assert set(r.names("parameter")) == set(model)
    for name, t in model.items():
        assert bit_equal(r.read(name), t), name
    assert m.extra["converted_from"]["nxd"]["qkv_linear"] == TAGS[tag].get("qkv_linear", False)
    if "train" not in tag:
        assert m.optimizer is None
        return
    for name in model:
        for key in ("exp_avg", "exp_avg_sq"):
            assert bit_equal(r.read(f"optim/{name}/{key}"), optim[f"{name}.{key}"]), (name, key)
        step = treecodec.decode(m.optimizer["state"][name]["step"])
        assert bit_equal(step, optim[f"{name}.step"])
    order = [p["name"] for p in json.loads((ROOT / "truth.json").read_text())["parameters"]]
    assert m.optimizer["param_groups"][0]["params"] == order  # HF model order, one group
    assert m.optimizer["param_groups"][0]["lr"] == 0.000999743108100344
    assert treecodec.decode(m.scheduler) == json.loads((ROOT / "scheduler.json").read_text())
    assert treecodec.decode(m.user) == {"total_steps": 3, "batch_idx": 3, "epoch": 0}
    assert m.step == 3


def test_fixture_back_to_neuron_and_nxd_native(truth, tmp_path: Path) -> None:
    """Training tag -> cuda -> neuron (same flags) -> NxD-native tag: the rank files equal the originals."""
    _, _, cfg = truth
    tag = ROOT / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
    convert(str(tag), str(tmp_path / "cuda"), ConvertOptions(to="cuda", config=cfg))
    convert(
        str(tmp_path / "cuda"),
        str(tmp_path / "neuron"),
        ConvertOptions.neuron(tp=2, dp=2, qkv_linear=True),
    )
    convert(
        str(tmp_path / "neuron"),
        str(tmp_path / "nxd" / "step_3"),
        ConvertOptions.neuron(format="nxd", tp=2, dp=2, qkv_linear=True),
    )
    orig = nxd.read_tag(tag)
    new = nxd.read_tag(tmp_path / "nxd" / "step_3")
    assert new.meta.zero1 and new.meta.dp_size == 2
    for rank, sd in orig.per_rank_model.items():
        assert list(new.per_rank_model[rank]) == list(sd)
        for n, t in sd.items():
            assert bit_equal(new.per_rank_model[rank][n], t), (rank, n)
        o, p = orig.per_rank_optimizer[rank], new.per_rank_optimizer[rank]
        for n, per in o["state"].items():
            for k, v in per.items():
                assert bit_equal(p["state"][n][k], v), (rank, n, k)
        assert p["param_groups"] == o["param_groups"]
    assert new.scheduler == orig.scheduler and new.user_content == orig.user_content


def test_fixture_trn2_replicas_checked(truth, tmp_path: Path) -> None:
    """A Neuron checkpoint whose KV copies disagree (e.g. NxD's trn2 tiling bug) is refused, not silently merged."""
    _, _, cfg = truth
    cuda = tmp_path / "cuda"
    convert(str(ROOT / "nxd_from_full_tp2_qkvlinear"), str(cuda), ConvertOptions(to="cuda", config=cfg))
    neuron = tmp_path / "neuron"
    convert(
        str(cuda),
        str(neuron),
        ConvertOptions.neuron(tp=4, qkv_linear=True, kv_size_multiplier=2, hw="trn2"),
    )
    # swap the two copies of KV head 0 with KV head 1 in one layer's k: copies now disagree
    import dataclasses

    from ckpt.converters.ckpt import ManifestSource
    from ckpt.converters.engine import plan_to_cuda, produce

    src = ManifestSource(str(neuron))
    name = "model.layers.0.self_attn.qkv_proj.weight_k"
    real = src.read

    def tampered(piece):  # noqa: ANN001, ANN202
        if piece.name == name and piece.rank == (1, 0):  # rank 1's KV slot := rank 2's (another KV head)
            return real(dataclasses.replace(piece, rank=(2, 0)))
        return real(piece)

    src.read = tampered  # type: ignore[method-assign]
    conv = plan_to_cuda(src)
    (out,) = [t for t in conv.tensors if t.desc.name == "model.layers.0.self_attn.k_proj.weight"]
    from ckpt.errors import LayoutError

    with pytest.raises(LayoutError, match="differs from the one on"):
        produce(conv, out.parts[0])


def test_imported_neuron_manifest_converts_to_ground_truth(truth, tmp_path: Path) -> None:
    """Contract check with the Neuron side: a manifest written by ``nxd.manifest.import_tag`` (issue 3's importer)
    converts to the ground truth through our converter."""
    from ckpt.converters.nxd.manifest import import_tag

    model, optim, cfg = truth
    import_tag(ROOT / "nxd_train_tp2_dp2_zero1_xser" / "step_3", str(tmp_path / "neuron"), config=cfg)
    convert(str(tmp_path / "neuron"), str(tmp_path / "cuda"), ConvertOptions(to="cuda", from_="neuron"))
    r = open_checkpoint(str(tmp_path / "cuda"))
    for name, t in model.items():
        assert bit_equal(r.read(name), t), name
        assert bit_equal(r.read(f"optim/{name}/exp_avg_sq"), optim[f"{name}.exp_avg_sq"]), name
