"""An HF Trainer checkpoint (two param groups: weight decay, then none) written as an NxD tag puts every Adam moment
on its own parameter when NxD loads it, and comes back exact.

NxD resumes with ``optimizer.load_state_dict``: torch hands the i-th pid of saved group g to the i-th parameter of the
live group g, so the tag's pids must follow the live NxD model's parameter order inside each group.  The "live NxD
optimizer" here is built the way NxD's Llama example builds it (``get_param_groups_by_weight_decay``: names without
"bias"/"norm" first, then the rest, each in ``named_parameters()`` order), with the parameter order taken from the
model files NxD's own code wrote (``fixtures/nxd/llama_gqa_h64``, same config and layout: TP 2, ``qkv_linear``), so
the check does not trust ckpt's own order table.  The Trainer's ``exp_avg`` is set equal to the parameter itself, so
the moment that lands on a parameter must equal that parameter's weights in the tag, whatever the layout did to both.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from ckpt.cli.main import cli
from ckpt.converters import nxd
from ckpt.converters.convert import ConvertOptions, convert
from click.testing import CliRunner

from ckpt import open_checkpoint
from ckpt.errors import CorruptionError, StateMismatchError
from ckpt.layouts import bit_equal
from ckpt.layouts.nxd_order import nxd_param_order
from tests.cli_helpers import FIX, tree

transformers = pytest.importorskip("transformers")

#: NxD's own model file for this config and layout: its key order is NxD's module order
NXD_ORDER_FILE = (
    FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
)
NO_DECAY = ("bias", "norm")  # NxD examples' get_param_groups_by_weight_decay


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((FIX / "config.json").read_text())


@pytest.fixture(scope="module")
def trainer_ckpt(tmp_path_factory: pytest.TempPathFactory, config: dict) -> Path:
    """A ``checkpoint-2`` folder as ``Trainer`` writes it: AdamW over the Trainer's two groups, two steps."""
    from transformers import AutoConfig, LlamaForCausalLM, Trainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(AutoConfig.for_model(**config))
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    x = torch.randint(0, config["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        for _, p in named:  # exp_avg := the parameter: where a moment lands can be read off its values
            opt.state[p]["exp_avg"].copy_(p)
    ck = tmp_path_factory.mktemp("trainer") / "checkpoint-2"
    model.save_pretrained(ck)
    torch.save(opt.state_dict(), ck / "optimizer.pt")
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    assert [len(g["params"]) for g in opt.state_dict()["param_groups"]] == [30, 9]
    return ck


@pytest.fixture(scope="module")
def tags(trainer_ckpt: Path, config: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tags")
    out = {}
    for kind, kw in {"plain": dict(dp=1), "zero1": dict(dp=2, zero1=True)}.items():
        out[kind] = root / kind / "step_2"
        convert(
            str(trainer_ckpt),
            str(out[kind]),
            ConvertOptions.neuron(format="nxd", tp=2, qkv_linear=True, config=config, **kw),
        )
    return out


def _nxd_groups(model_names: list[str]) -> list[list[str]]:
    """The live NxD optimizer's groups: NxD's order (from NxD's own files), split by weight decay."""
    order = list(torch.load(NXD_ORDER_FILE, weights_only=True))
    assert sorted(order) == sorted(model_names)
    return [
        [n for n in order if not any(m in n for m in NO_DECAY)],
        [n for n in order if any(m in n for m in NO_DECAY)],
    ]


def _rank_files(tag: Path, tp: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    model = torch.load(tag / "model" / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_00.pt", weights_only=True)
    optim = sorted((tag / "optim").glob(f"dp_rank_*_tp_rank_{tp:02d}_pp_rank_00.pt"))
    return model, [torch.load(f, weights_only=True) for f in optim]


@pytest.mark.parametrize("tp", [0, 1])
def test_live_nxd_style_optimizer_gets_each_moment_on_its_parameter(tags: dict[str, Path], tp: int) -> None:
    """Plain tag: a real ``torch.optim.AdamW`` built NxD-style loads the file; every parameter's exp_avg equals
    its own weights.  The file records ``param_names``, equal to the live groups."""
    model, (optim,) = _rank_files(tags["plain"], tp)
    groups = _nxd_groups(list(model))
    params = {n: torch.nn.Parameter(torch.zeros_like(t)) for n, t in model.items()}
    live = torch.optim.AdamW([{"params": [params[n] for n in g]} for g in groups], lr=1e-3)
    live.load_state_dict(optim)
    for name, p in params.items():
        assert bit_equal(live.state[p]["exp_avg"], model[name]), name
    assert [g["weight_decay"] for g in live.param_groups] == [0.1, 0.0]
    assert [g["param_names"] for g in optim["param_groups"]] == groups


def test_zero1_shards_put_each_moment_on_its_parameter(tags: dict[str, Path]) -> None:
    """ZeRO-1 tag (dp 2): torch_xla's ``load_state_dict`` maps pids by position like torch; the i-th pid of group g,
    merged over DP, is the exp_avg of the i-th parameter of the live group g."""
    for tp in (0, 1):
        model, dp = _rank_files(tags["zero1"], tp)
        assert len(dp) == 2
        for g, live in zip(dp[0]["param_groups"], _nxd_groups(list(model)), strict=True):
            for pid, name in zip(g["params"], live, strict=True):
                rows = dp[0]["shape_info"][pid][0]
                merged = torch.cat([d["base_state"][pid]["exp_avg"] for d in dp])[:rows]
                assert bit_equal(merged, model[name]), (tp, name)
            assert g["param_names"] == live


def test_tag_back_to_trainer_is_exact(
    tags: dict[str, Path], trainer_ckpt: Path, config: dict, tmp_path: Path
) -> None:
    """HF Trainer -> NxD tag -> HF Trainer: the same numbering, groups and moments, bit for bit; and -> our format:
    every moment on the same name."""
    src = torch.load(trainer_ckpt / "optimizer.pt", weights_only=True)
    for kind, tag in tags.items():
        back = tmp_path / kind / "checkpoint-2"
        convert(str(tag), str(back), ConvertOptions(to="cuda", format="hf-trainer", config=config))
        got = torch.load(back / "optimizer.pt", weights_only=True)
        assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in src["param_groups"]]
        assert [g["weight_decay"] for g in got["param_groups"]] == [0.1, 0.0]
        assert set(got["state"]) == set(src["state"])
        for i, per in src["state"].items():
            for k, v in per.items():
                assert bit_equal(got["state"][i][k], v), (kind, i, k)
    from transformers import AutoConfig, LlamaForCausalLM, Trainer

    with torch.device("meta"):
        hf = LlamaForCausalLM(AutoConfig.for_model(**config))
    decay = set(Trainer.get_decay_parameter_names(None, hf))
    names = [n for n, _ in hf.named_parameters()]
    pid_name = [n for n in names if n in decay] + [n for n in names if n not in decay]
    ours = tmp_path / "ours"
    convert(str(tags["zero1"]), str(ours), ConvertOptions(to="cuda", config=config))
    r = open_checkpoint(str(ours))
    for pid, name in enumerate(pid_name):
        for k in ("exp_avg", "exp_avg_sq"):
            assert bit_equal(r.read(f"optim/{name}/{k}"), src["state"][pid][k]), (name, k)


def _one_error(code: int, *args: object) -> str:
    """``ckpt ARGS`` in process (imports are warm): exit ``code`` and exactly one ``ckpt: error:`` line."""
    r = CliRunner().invoke(cli, [str(a) for a in args])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == code and len(lines) == 1 and lines[0].startswith("ckpt: error: "), r.output
    return lines[0]


def _rewrite_groups(tag: Path, edit) -> None:
    for f in (tag / "optim").glob("*.pt"):
        d = torch.load(f, weights_only=True)
        for g in d["param_groups"]:
            edit(g)
        torch.save(d, f)


def test_tag_without_param_names_is_named_by_nxd_order(tags: dict[str, Path], tmp_path: Path) -> None:
    """As NxD's own optimizers save (no names): two groups are named by NxD's Llama order (pp 1, known) split by
    weight decay; a layout whose NxD order ckpt does not know is refused, naming the file."""
    tag = tmp_path / "step_2"
    shutil.copytree(tags["zero1"], tag)
    _rewrite_groups(tag, lambda g: g.pop("param_names"))
    want = nxd.read_tag(tags["zero1"])
    got = nxd.read_tag(tag)
    for rank, opt in want.per_rank_optimizer.items():
        assert got.per_rank_optimizer[rank]["param_groups"] == opt["param_groups"]
        for name, per in opt["state"].items():
            assert bit_equal(got.per_rank_optimizer[rank]["state"][name]["exp_avg"], per["exp_avg"]), name
    with pytest.raises(
        StateMismatchError, match=r"optim/dp_rank_00_tp_rank_00_pp_rank_00\.pt: 2 param groups"
    ):
        nxd.read_tag(tag, rule_set="nxd-qwen3")
    # a model file in another order than NxD's (what ckpt wrote from an HF source before param_names: sorted keys)
    # says nothing about the pids: refused, not guessed
    for f in (tag / "model").glob("*.pt"):
        sd = torch.load(f, weights_only=True)
        torch.save(dict(sorted(sd.items())), f)
    with pytest.raises(
        StateMismatchError, match=r"no param_names, and the model file lists 'lm_head.weight' where"
    ):
        nxd.read_tag(tag)


def test_groups_disagreeing_with_names_are_refused(tags: dict[str, Path], tmp_path: Path) -> None:
    """param_names that swap two same-shaped parameters of different groups' sizes, miss a pid, or contradict the
    caller's names are refused; the CLI says so in one line naming the file and writes nothing."""
    tag = tmp_path / "step_2"
    shutil.copytree(tags["plain"], tag)

    def short(g: dict) -> None:
        g["param_names"] = g["param_names"][:-1]

    _rewrite_groups(tag, short)
    with pytest.raises(CorruptionError, match=r"param group 0 lists 26 pids but 25 param_names"):
        nxd.read_tag(tag)
    dst = tmp_path / "dst"
    err = _one_error(
        1, "convert", tag, dst, "--to", "cuda", "--format", "ckpt", "--config", FIX / "config.json"
    )
    assert "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt: param group 0 lists 26 pids but 25 param_names" in err
    assert tree(dst) == {}

    shutil.rmtree(tag)
    shutil.copytree(tags["plain"], tag)

    def moved(g: dict) -> None:  # a norm named in the decay group: the names no longer fit the shapes
        if g["weight_decay"] == 0.1:
            g["param_names"][1] = "model.layers.0.input_layernorm.weight"

    _rewrite_groups(tag, moved)
    with pytest.raises(CorruptionError, match=r"param_names do not name pids"):
        nxd.read_tag(tag)
    names = {(t, 0, 0): list(torch.load(NXD_ORDER_FILE, weights_only=True)) for t in (0, 1)}
    with pytest.raises(StateMismatchError, match=r"disagree with the file's param_names"):
        nxd.read_tag(tags["plain"], param_names=names)


def test_two_groups_refused_where_nxd_order_is_unknown(trainer_ckpt: Path, tmp_path: Path) -> None:
    """pp 2: NxD traces each stage into a GraphModule (first-use order), which ckpt has not verified: an optimizer
    with two groups is refused before anything is written."""
    dst = tmp_path / "nxd"
    err = _one_error(
        2, "convert", trainer_ckpt, dst, "--to", "neuron", "--format", "nxd", "--tp", "1", "--pp", "2"
    )
    assert "2 param groups" in err and "pp=2" in err and "--format ckpt --to neuron" in err
    assert tree(dst) == {}


def test_order_table_is_nxds_module_order() -> None:
    """The order table gives NxD's own files' key order for every layout of the fixtures (qkv_linear and q/k/v)."""
    for rel in (
        NXD_ORDER_FILE,
        FIX / "nxd_from_full_tp2_pp2" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt",
    ):
        names = list(torch.load(rel, weights_only=True))
        assert nxd_param_order(reversed(names), "nxd-llama") == names
    assert nxd_param_order(names, "nxd-llama", pp=2) is None
    assert nxd_param_order([*names, "model.layers.0.self_attn.q_norm.weight"], "nxd-llama") is None
    assert nxd_param_order(names, "nxd-qwen3") is None


def test_qkv_biases_follow_nxds_registration() -> None:
    """Qwen2-style q/k/v biases: HF lists each bias after its weight; NxD's ``GQAQKVColumnParallelLinear``
    registers ``weight_q, weight_k, weight_v`` then ``bias_q, bias_k, bias_v`` (NxD 2.29 ``modules/qkv_linear.py``),
    so a single group taken over from HF order would put bias moments on K/V weights; the writer reorders them."""
    p = "model.layers.0.self_attn."
    hf_mapped = [f"{p}qkv_proj.{w}_{x}" for x in "qkv" for w in ("weight", "bias")]
    assert nxd_param_order([*hf_mapped, f"{p}o_proj.weight", f"{p}o_proj.bias"], "nxd-llama") == [
        *(f"{p}qkv_proj.weight_{x}" for x in "qkv"),
        *(f"{p}qkv_proj.bias_{x}" for x in "qkv"),
        f"{p}o_proj.weight",
        f"{p}o_proj.bias",
    ]
