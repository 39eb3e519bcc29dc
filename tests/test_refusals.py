"""No silent loss (issue 9): what the converter and the Neuron saver do not understand is refused with one line that
names the tensor and the fix; what must be equal (replicated copies) is compared.  Real NxD fixtures (tampered in
tmp copies), real conversions, the real CLI."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from ckpt.cli.main import cli
from ckpt.converters.convert import ConvertOptions, RunOptions, convert, load_config
from ckpt.converters.nxd import import_tag
from click.testing import CliRunner

from ckpt import open_checkpoint
from ckpt.errors import LayoutError
from ckpt.layouts import bit_equal
from ckpt.layouts.families import get_rule_set
from ckpt.layouts.rules import Kind, rule_for
from ckpt.saving.writer import StreamingWriter

ROOT = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"
PP_TAG = ROOT / "nxd_from_full_tp2_pp2"  # model only, tp 2, pp 2, no marker (NxD converter output)
CONFIG = load_config(str(ROOT / "config.json"))
EXPERT = "model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight"


def _tamper(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001
    """A copy of NxD tag ``src`` whose model rank files went through ``edit(state, tp, pp)``."""
    shutil.copytree(src, dst)
    for f in sorted((dst / "model").glob("*.pt")):
        tp, pp = int(f.stem.split("_")[5]), int(f.stem.split("_")[8])
        state = torch.load(f, weights_only=True)
        edit(state, tp, pp)
        torch.save(state, f)
    return dst


def _expert(layer: int, seed: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed * 100 + layer))


def _inject(*, sharded: bool):  # noqa: ANN202
    """Add every layer's ``EXPERT`` tensor: different on each TP rank (sharded), or the same (replicated)."""

    def edit(state: dict, tp: int, pp: int) -> None:
        for name in list(state):
            if name.endswith(".mlp.down_proj.weight"):
                layer = int(name.split(".")[2])
                state[EXPERT.replace("layers.0.", f"layers.{layer}.")] = _expert(layer, tp if sharded else 0)

    return edit


def _cuda_with(tmp: Path, extra: dict[str, torch.Tensor]) -> Path:
    """The fixture's ground-truth model as a CUDA-layout checkpoint, plus ``extra`` tensors."""
    from safetensors.torch import load_file

    w = StreamingWriter(str(tmp / "cuda"))
    for n, t in {**load_file(ROOT / "model.safetensors"), **extra}.items():
        w.add(n, t)
    w.commit(step=1, backend="cuda", trees={"extra": {"config": CONFIG}})
    return tmp / "cuda"


# --------------------------------------------------------------------------------- 1. unknown tensor names


def test_rule_set_names_replicated_tensors_and_refuses_unknown() -> None:
    rules = get_rule_set("nxd-llama")
    for name in (
        "model.norm.weight",
        "model.layers.3.input_layernorm.weight",
        "model.layers.3.post_attention_layernorm.weight",
        "model.layers.0.self_attn.o_proj.bias",
        "model.layers.0.mlp.down_proj.bias",
        "model.rotary_emb.inv_freq",
    ):
        assert rule_for(name, rules).kind is Kind.REPLICATED, name
    with pytest.raises(LayoutError, match="1 tensor matches no rule of layout rule set nxd-llama: " + EXPERT):
        rule_for(EXPERT, rules)


def test_nxd_tag_with_unknown_sharded_tensor_is_refused(tmp_path: Path) -> None:
    tag = _tamper(PP_TAG, tmp_path / "tag", _inject(sharded=True))
    for to in ("cuda", "neuron"):
        dst = tmp_path / f"out_{to}"
        with pytest.raises(LayoutError, match=r"4 tensors match no rule .*" + EXPERT + ".*--replicated GLOB"):
            convert(str(tag), str(dst), ConvertOptions(to=to, config=CONFIG))  # type: ignore[arg-type]
        assert not dst.exists()


def test_declared_replicated_tensor_with_diverged_copies_is_refused(tmp_path: Path) -> None:
    tag = _tamper(PP_TAG, tmp_path / "tag", _inject(sharded=True))
    opts = ConvertOptions(to="cuda", config=CONFIG, replicated=["*.expert_mlps.*"])
    with pytest.raises(LayoutError, match=EXPERT + ": the copy stored on tp 1 pp 0 differs"):
        convert(str(tag), str(tmp_path / "out"), opts)
    assert not (tmp_path / "out").exists()


def test_declared_replicated_tensor_converts_exactly_and_is_recorded(tmp_path: Path) -> None:
    tag = _tamper(PP_TAG, tmp_path / "tag", _inject(sharded=False))
    expect = _expert(0, 0)
    convert(
        str(tag), str(tmp_path / "cuda"), ConvertOptions(to="cuda", config=CONFIG, replicated=["*.mlp_op.*"])
    )
    assert bit_equal(open_checkpoint(str(tmp_path / "cuda")).read(EXPERT), expect)
    # to another TP layout: the glob is needed again (the CUDA checkpoint does not know the layout rules)...
    with pytest.raises(LayoutError, match="match no rule"):
        convert(str(tmp_path / "cuda"), str(tmp_path / "tp1"), ConvertOptions.neuron(tp=1, pp=1))
    # ...and an import records it, so converting the import needs nothing more
    import_tag(tag, str(tmp_path / "neuron"), config=CONFIG, replicated=["*.mlp_op.*"])
    m = open_checkpoint(str(tmp_path / "neuron")).manifest
    assert m.extra["nxd"]["replicated"] == ["*.mlp_op.*"] and m.tensors[EXPERT].partition is None
    convert(str(tmp_path / "neuron"), str(tmp_path / "back"), ConvertOptions(to="cuda"))
    assert bit_equal(open_checkpoint(str(tmp_path / "back")).read(EXPERT), expect)


def test_full_to_neuron_refuses_unknown_lists_names_and_count(tmp_path: Path) -> None:
    extra = {f"model.layers.{i}.mlp.router.weight": torch.ones(4, 64) for i in range(4)}
    extra["model.extra_bias"] = torch.ones(64)
    src = _cuda_with(tmp_path, extra)
    with pytest.raises(LayoutError) as e:
        convert(str(src), str(tmp_path / "n"), ConvertOptions.neuron(tp=2))
    msg = str(e.value)
    assert msg.startswith("5 tensors match no rule of layout rule set nxd-llama: ")
    assert "model.layers.0.mlp.router.weight" in msg and "model.extra_bias" in msg
    assert not (tmp_path / "n").exists()
    opts = ConvertOptions.neuron(tp=2, replicated=["*.router.weight", "model.extra_bias"])
    convert(str(src), str(tmp_path / "n"), opts)
    n = open_checkpoint(str(tmp_path / "n"))
    assert n.manifest.tensors["model.extra_bias"].partition is None
    convert(str(tmp_path / "n"), str(tmp_path / "back"), ConvertOptions(to="cuda"))
    back = open_checkpoint(str(tmp_path / "back"))
    for name, t in extra.items():
        assert bit_equal(back.read(name), t)


def test_cli_replicated_flag(tmp_path: Path) -> None:
    tag = _tamper(PP_TAG, tmp_path / "tag", _inject(sharded=False))
    cfg = str(ROOT / "config.json")
    base = ["convert", str(tag), str(tmp_path / "out"), "--to", "cuda", "--config", cfg]
    r = CliRunner().invoke(cli, base)
    assert r.exit_code == 2 and "ckpt: error:" in r.output and EXPERT in r.output, r.output
    assert not (tmp_path / "out").exists()
    r = CliRunner().invoke(cli, [*base, "--replicated", "*.mlp_op.*", "--replicated", "*.nothing"])
    assert r.exit_code == 0, r.output


def test_existing_fixtures_unchanged_by_explicit_rules(tmp_path: Path) -> None:
    """Every fixture still converts (explicit replicated rules cover norms); RunOptions untouched."""
    for tag in ("nxd_from_full_tp2_pp2", "nxd_from_full_tp2_qkvlinear"):
        convert(str(ROOT / tag), str(tmp_path / tag), ConvertOptions(to="cuda", config=CONFIG), RunOptions())


# --------------------------------------------------------------------------------- 2. replicas compared


def _diverge_norm(state: dict, tp: int, pp: int) -> None:
    """TP rank 1's copy of one replicated norm drifts by one ulp (a desynchronised run)."""
    name = "model.layers.0.input_layernorm.weight"
    if tp == 1 and name in state:
        state[name] = torch.nextafter(state[name], torch.full_like(state[name], 2.0))


@pytest.mark.parametrize("verify", [True, False])
def test_diverged_replicated_norm_refused_by_convert_and_import(tmp_path: Path, verify: bool) -> None:
    tag = _tamper(PP_TAG, tmp_path / "tag", _diverge_norm)
    run = RunOptions(verify=verify)
    for to in ("cuda", "neuron"):
        with pytest.raises(LayoutError, match="input_layernorm.weight: the copy stored on tp 1 pp 0 differs"):
            convert(str(tag), str(tmp_path / to), ConvertOptions(to=to, config=CONFIG), run)  # type: ignore[arg-type]
        assert not (tmp_path / to).exists()
    with pytest.raises(LayoutError, match="the copy stored on tp 1 pp 0 differs"):
        import_tag(tag, str(tmp_path / "imp"), verify=verify)
    assert not (tmp_path / "imp").exists()


# --------------------------------------------------------------------------------- 4. layouts not handled


def test_tied_embeddings_with_pp_refused() -> None:
    from ckpt.layouts import LayoutSpec

    cfg = {**CONFIG, "tie_word_embeddings": True}
    with pytest.raises(LayoutError, match="tie_word_embeddings with --pp 2 is not supported"):
        LayoutSpec.from_hf_config(cfg, tp=2, pp=2)
    assert LayoutSpec.from_hf_config(cfg, tp=2, pp=1).model.tie_word_embeddings


def test_unsupported_model_type_reaching_nxd_source_is_named(tmp_path: Path) -> None:
    cfg = {**CONFIG, "model_type": "gpt_neox"}
    for tag in (PP_TAG, ROOT / "nxd_from_full_tp2_qkvlinear"):
        with pytest.raises(
            LayoutError, match=r"model_type 'gpt_neox' is not supported \(supported: llama, mistral"
        ):
            convert(str(tag), str(tmp_path / "out"), ConvertOptions(to="cuda", config=cfg))
        with pytest.raises(LayoutError, match="model_type 'gpt_neox' is not supported"):
            import_tag(tag, str(tmp_path / "imp"), config=cfg)
        assert not (tmp_path / "out").exists() and not (tmp_path / "imp").exists()


def test_config_without_model_type_refused_unless_given(tmp_path: Path) -> None:
    cfg = {k: v for k, v in CONFIG.items() if k != "model_type"}
    with pytest.raises(LayoutError, match="config.json has no model_type.*--model-type"):
        convert(str(PP_TAG), str(tmp_path / "out"), ConvertOptions(to="cuda", config=cfg))
    assert not (tmp_path / "out").exists()
    convert(str(PP_TAG), str(tmp_path / "out"), ConvertOptions(to="cuda", config=cfg, model_type="llama"))
    assert open_checkpoint(str(tmp_path / "out")).manifest.extra["config"]["model_type"] == "llama"
    with pytest.raises(LayoutError, match="--model-type mistral contradicts"):
        ConvertOptions(to="cuda", config=CONFIG, model_type="mistral")
    (tmp_path / "cfg.json").write_text(__import__("json").dumps(cfg))
    base = [
        "convert",
        str(PP_TAG),
        str(tmp_path / "cli"),
        "--to",
        "cuda",
        "--config",
        str(tmp_path / "cfg.json"),
    ]
    r = CliRunner().invoke(cli, base)
    assert r.exit_code == 2 and "no model_type" in r.output and not (tmp_path / "cli").exists(), r.output
    r = CliRunner().invoke(cli, [*base, "--model-type", "llama"])
    assert r.exit_code == 0, r.output


# --------------------------------------------------------------------------------- 5. facts recorded right

ZERO1_TAG = ROOT / "nxd_train_tp2_dp2_zero1_plain" / "step_3"


def _groups_edit(value):  # noqa: ANN001, ANN202
    def edit(path: Path) -> None:
        for f in sorted((path / "optim").glob("*.pt")):
            sd = torch.load(f, weights_only=True)
            for g in sd["param_groups"]:
                if value is None:
                    g.pop("decoupled_weight_decay", None)
                else:
                    g["decoupled_weight_decay"] = value
            torch.save(sd, f)

    return edit


@pytest.mark.parametrize(
    "edit,base",
    [(None, "torch.optim.adamw.AdamW"), (False, "torch.optim.adam.Adam"), ("drop", "unknown")],
)
def test_nxd_optimizer_class_is_what_the_tag_says(tmp_path: Path, edit, base: str) -> None:  # noqa: ANN001
    tag = tmp_path / "tag"
    shutil.copytree(ZERO1_TAG, tag)
    if edit is not None:
        _groups_edit(None if edit == "drop" else edit)(tag)
    import_tag(tag, str(tmp_path / "imp"))
    opt = open_checkpoint(str(tmp_path / "imp")).manifest.optimizer
    assert opt["type"].endswith("NeuronZero1Optimizer") and opt["base"] == base


def test_infer_optimizer_units() -> None:
    from ckpt.converters.nxd.optim_state import infer_optimizer

    assert infer_optimizer(
        {"momentum_buffer"}, [{"momentum": 0.9, "dampening": 0, "nesterov": False}]
    ).endswith("SGD")
    assert (
        infer_optimizer({"step", "square_avg"}, [{"alpha": 0.99}]) == "unknown"
    )  # RMSprop-like: not guessed
    assert infer_optimizer({"exp_avg", "exp_avg_sq"}, [{"decoupled_weight_decay": True}, {}]) == "unknown"


def test_import_with_config_checks_every_rank_tensor_against_it(tmp_path: Path) -> None:
    """The highest TP rank's files deleted: the tag reads as tp 1, but with the config its shapes are refused."""
    tag = tmp_path / "tag"
    shutil.copytree(ZERO1_TAG, tag)
    for f in [*tag.glob("model/*tp_rank_01*"), *tag.glob("optim/*tp_rank_01*")]:
        f.unlink()
    with pytest.raises(LayoutError, match="but the config implies"):
        import_tag(tag, str(tmp_path / "imp"), config=CONFIG)
    assert not (tmp_path / "imp").exists()
