"""NxD tags of MoE models (Mixtral, Qwen3-MoE) with expert parallelism, both ways, against NxD's own layers.

Ground truth: ``fixtures/nxd_layers`` (NxD 2.29's ``RouterTopK`` / ``Experts`` / GQA layers run on CPU gloo ranks; see
its README), trn1 and trn2.  An NxD tag holding exactly those rank tensors (``model/dp_rank_00_ep_rank_EE_tp_rank_TT_
pp_rank_PP.pt``, as NxD's ``save_checkpoint`` names them with EP) converts to the HF truth tensor for tensor and to a
model ``transformers`` loads with the truth's logits; HF -> NxD tag writes exactly NxD's rank tensors (plain and xser,
xser keeping non-expert tensors once under ``ep_rank_00`` like NxD); neuron -> cuda -> neuron is bit-exact over
dims / TP / EP / trn1 / trn2 (hypothesis).  What is not converted is refused in one line with nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt.converters.convert import convert
from ckpt.converters.nxd.reader import read_tag
from ckpt.converters.nxd.writer import TagWriter
from ckpt.converters.options import ConvertOptions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from ckpt.errors import CkptError, CorruptionError, LayoutError
from ckpt.layouts import LayoutSpec
from ckpt.layouts.experts import full_state_to_nxd_ep
from ckpt.layouts.names import EXPERT_STACKED
from ckpt.layouts.spec import ModelDims

transformers = pytest.importorskip("transformers")
FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nxd_layers"
CASES = {  # fixture -> (hw, NxD rank files per (tp, ep))
    "mixtral_tp2_ep2": "trn1",
    "mixtral_tp2_ep2_trn2": "trn2",
    "qwen3_moe_tp2_ep2_trn1": "trn1",
    "qwen3_moe_tp2_ep2_trn2": "trn2",
}
TP, EP = 2, 2
REPLICATED = ("layernorm.weight", "model.norm.weight", "q_norm.weight", "k_norm.weight")
pytestmark = pytest.mark.filterwarnings("ignore:.*records no training step:UserWarning")


def truth(case: str):
    d = FIX / case
    cfg = json.loads((d / "hf" / "config.json").read_text())
    hf = load_file(str(d / "hf" / "model.safetensors"))
    ranks = {
        (t, 0, e): load_file(str(d / f"rank_tp{t}_ep{e}.safetensors")) for t in range(TP) for e in range(EP)
    }
    return cfg, hf, ranks


def model_file(tp: int, pp: int, ep: int) -> str:
    return f"dp_rank_00_ep_rank_{ep:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def write_nxd_tag(dst: Path, ranks, hf, *, xser: bool) -> None:
    """An NxD tag of NxD's layers' rank tensors plus the norms (plain HF modules in NxD's models: whole on every
    rank).  Plain: ``torch.save`` at NxD's file names, written here; xser: ckpt's writer (checked against NxD's
    naming in test_hf_to_nxd_tag_is_nxd_layers_state)."""
    norms = {n: t for n, t in hf.items() if n.endswith(REPLICATED)}
    if xser:
        experts = {n for sd in ranks.values() for n in sd if EXPERT_STACKED.match(n)}
        with TagWriter(dst, xser=True, zero1=False, ep_size=EP, expert_tensors=experts) as w:
            for rank, sd in sorted(ranks.items()):
                w.write_rank(rank, {**sd, **norms})
            w.finish()
        return
    (dst / "model").mkdir(parents=True)
    (dst / "checkpoint").write_text("1")
    for (t, p, e), sd in ranks.items():
        torch.save({**sd, **norms}, dst / "model" / model_file(t, p, e))
    (dst / "done").write_text("1")


def load_hf(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


#: each family on trn1 and trn2, each with one of the two file forms
FORMS = [("mixtral_tp2_ep2", False), ("mixtral_tp2_ep2_trn2", True), ("qwen3_moe_tp2_ep2_trn1", True),
         ("qwen3_moe_tp2_ep2_trn2", False)]  # fmt: skip


@pytest.mark.parametrize("case, xser", FORMS)
def test_nxd_tag_to_hf_equals_truth(case, xser, tmp_path):
    cfg, hf, ranks = truth(case)
    tag = tmp_path / "step_3"
    write_nxd_tag(tag, ranks, hf, xser=xser)
    out = tmp_path / "hf"
    convert(
        str(tag),
        str(out),
        ConvertOptions(to="cuda", format="hf", config=cfg, source_flags={"hw": CASES[case]}),
    )
    got = load_hf(out)
    assert got.keys() == hf.keys()
    for name, t in hf.items():
        assert torch.equal(got[name], t), name
    if not xser:  # the export is a model transformers loads, with the truth model's logits
        want = transformers.AutoModelForCausalLM.from_pretrained(FIX / case / "hf").eval()
        mine = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        ids = torch.randint(0, cfg["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(mine(ids).logits, want(ids).logits)


@pytest.mark.parametrize("case, xser", [(c, not x) for c, x in FORMS])
def test_hf_to_nxd_tag_is_nxd_layers_state(case, xser, tmp_path):
    cfg, hf, ranks = truth(case)
    tag = tmp_path / "step_3"
    layout = {"tp": TP, "ep": EP, "qkv_linear": True, "hw": CASES[case]}
    convert(
        str(FIX / case / "hf"), str(tag), ConvertOptions(to="neuron", format="nxd", xser=xser, layout=layout)
    )
    names = sorted(p.name for p in (tag / "model").iterdir() if p.suffix == ".pt" and ".info" not in p.name)
    assert names == sorted(
        model_file(t, 0, e) for t in range(TP) for e in range(EP)
    )  # NxD's _get_path(ep=True)
    got = read_tag(tag).per_rank_model
    assert got.keys() == ranks.keys()
    for rank, theirs in ranks.items():
        mine = got[rank]
        assert {n for n in mine if not n.endswith(REPLICATED)} == set(theirs), rank
        for name, t in theirs.items():
            assert torch.equal(mine[name], t), (rank, name)
        for name in mine.keys() - theirs.keys():
            assert torch.equal(mine[name], hf[name]), (rank, name)
    if (
        xser
    ):  # NxD keeps each non-expert tensor once, under ep_rank_00, and marks the experts expert_model_parallel
        for t in range(TP):
            f = tag / "model" / model_file(t, 0, 1)
            info = torch.load(f"{f}.info.pt", weights_only=True)
            refs = torch.load(f, weights_only=False)
            experts = {r.tid for n, r in refs.items() if EXPERT_STACKED.match(n)}
            assert {tid for tid, i in info.items() if i["expert_model_parallel"]} == experts
            assert {int(p.stem.split("_")[1]) for p in Path(f"{f}.tensors").iterdir()} == experts


def test_nxd_experts_forward_on_written_shards_is_the_hf_experts(tmp_path):
    """NxD's own Experts.forward output (fixture) is what each HF expert computes on the expert weights ckpt wrote
    for that EP rank (Qwen3-MoE, trn2): the functional proof of the expert order over EP ranks."""
    case = "qwen3_moe_tp2_ep2_trn2"
    cfg, hf, _ = truth(case)
    tag = tmp_path / "t"
    layout = {"tp": TP, "ep": EP, "qkv_linear": True, "hw": "trn2"}
    convert(str(FIX / case / "hf"), str(tag), ConvertOptions(to="neuron", format="nxd", layout=layout))
    got = read_tag(tag).per_rank_model
    per = cfg["num_local_experts"] // EP
    inter = cfg["moe_intermediate_size"] // TP
    for k in range(EP):
        f = load_file(str(FIX / case / f"experts_forward_ep{k}.safetensors"))
        x = f["input"][0].double()
        out = torch.zeros_like(f["output"]).double()
        for t in range(TP):
            gu = got[(t, 0, k)]["model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight"].double()
            dn = got[(t, 0, k)]["model.layers.0.mlp.expert_mlps.mlp_op.down_proj.weight"].double()
            for s in range(per):
                h = x @ gu[s]
                out[s] += (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ dn[s]
        torch.testing.assert_close(out, f["output"].double(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ round trips


@st.composite
def moe_layouts(draw):
    family = draw(st.sampled_from(["mixtral", "qwen3_moe"]))
    tp = draw(st.sampled_from([1, 2]))
    experts = draw(st.sampled_from([2, 4]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if experts % e == 0]))
    kv = draw(st.sampled_from([1, 2, 4]))
    hw = draw(st.sampled_from(["trn1", "trn2"]))
    mult = max(1, tp // kv)
    cfg = {
        "model_type": family, "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": kv,
        "num_hidden_layers": draw(st.sampled_from([1, 2])), "vocab_size": 32, "tie_word_embeddings": False,
        "intermediate_size": draw(st.sampled_from([4, 8])), "num_experts_per_tok": 1, "num_local_experts": experts,
    }  # fmt: skip
    if family == "qwen3_moe":
        cfg |= {"head_dim": draw(st.sampled_from([4, 8])), "moe_intermediate_size": cfg["intermediate_size"]}
    layout = {"tp": tp, "ep": ep, "qkv_linear": True, "kv_size_multiplier": mult, "hw": hw}
    return cfg, layout, draw(st.booleans()), draw(st.integers(0, 2**16))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=moe_layouts())
def test_round_trip_nxd_to_hf_to_nxd_is_bit_exact(case, tmp_path_factory):
    cfg, layout, xser, seed = case
    tmp = tmp_path_factory.mktemp("rt")
    g = torch.Generator().manual_seed(seed)
    spec = LayoutSpec.from_hf_config(cfg, **layout)
    state = {n: torch.randn(s, generator=g) for n, s in ModelDims.from_hf_config(cfg).hf_shapes().items()}
    shards = full_state_to_nxd_ep(state, spec)
    experts = {n for sd in shards.values() for n in sd if EXPERT_STACKED.match(n)}
    with TagWriter(tmp / "a", xser=xser, zero1=False, ep_size=spec.ep, expert_tensors=experts) as w:
        for rank, sd in sorted(shards.items()):
            w.write_rank(rank, sd)
        w.finish()
    src_flags = {"hw": layout["hw"]}
    convert(
        str(tmp / "a"),
        str(tmp / "hf"),
        ConvertOptions(to="cuda", format="hf", config=cfg, source_flags=src_flags),
    )
    back = load_hf(tmp / "hf")
    assert back.keys() == state.keys() and all(torch.equal(back[n], t) for n, t in state.items())
    convert(
        str(tmp / "hf"), str(tmp / "b"), ConvertOptions(to="neuron", format="nxd", xser=xser, layout=layout)
    )
    a, b = read_tag(tmp / "a").per_rank_model, read_tag(tmp / "b").per_rank_model
    assert a.keys() == b.keys() == shards.keys()
    for rank, sd in a.items():
        assert list(sd) == list(b[rank]), rank
        for name, t in sd.items():
            assert t.dtype == b[rank][name].dtype and torch.equal(t, b[rank][name]), (rank, name)
    files = sorted(p.relative_to(tmp / "a").as_posix() for p in (tmp / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp / "b").as_posix() for p in (tmp / "b").rglob("*") if p.is_file())


def test_nxd_tag_to_ckpt_neuron_and_back_keeps_ep(tmp_path):
    """NxD tag (ep 2) -> our Neuron manifest keeps EP (layout.ep, partition.ep) -> NxD tag: the same rank files."""
    cfg, hf, ranks = truth("mixtral_tp2_ep2")
    write_nxd_tag(tmp_path / "a", ranks, hf, xser=False)
    convert(str(tmp_path / "a"), str(tmp_path / "ck"), ConvertOptions(to="neuron", config=cfg))
    from ckpt.format.reader import CheckpointReader

    m = CheckpointReader(str(tmp_path / "ck")).manifest
    assert (m.layout.tp, m.layout.ep) == (TP, EP)
    assert m.tensors["model.layers.0.mlp.expert_mlps.mlp_op.down_proj.weight"].desc.partition["ep"] == EP
    convert(str(tmp_path / "ck"), str(tmp_path / "b"), ConvertOptions(to="neuron", format="nxd"))
    a, b = read_tag(tmp_path / "a").per_rank_model, read_tag(tmp_path / "b").per_rank_model
    assert a.keys() == b.keys()
    assert all(torch.equal(t, b[r][n]) for r, sd in a.items() for n, t in sd.items())


# ------------------------------------------------------------------------------------------------ optimizer


def trained_tag(tag: Path, case: str, ep: int) -> tuple[dict, dict[str, torch.Tensor], dict[str, dict]]:
    """An NxD tag after one AdamW step of a plain (non-ZeRO) optimizer per (tp, pp, ep) rank, as NxD saves it without
    ZeRO-1 (``optim/dp_rank_00_ep_rank_EE_tp_rank_TT_pp_rank_PP.pt``, pids in the rank's parameter order), and the
    truth: the same step of AdamW on the whole HF model (AdamW is elementwise, so each rank's state is a shard of
    it).  Replicated tensors get identical gradients on every rank, as a synchronised run gives them."""
    cfg, hf, _ = truth(case)
    spec = LayoutSpec.from_hf_config(cfg, tp=TP, ep=ep, qkv_linear=True, hw=CASES[case])
    g = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(t.shape, generator=g) for n, t in hf.items()}
    full = {n: torch.nn.Parameter(t.clone()) for n, t in hf.items()}
    opt = torch.optim.AdamW(list(full.values()), lr=0.1)
    for n, q in full.items():
        q.grad = grads[n].clone()
    opt.step()
    want = {n: opt.state[q] for n, q in full.items()}
    shard_grads = full_state_to_nxd_ep(grads, spec)
    (tag / "model").mkdir(parents=True)
    (tag / "optim").mkdir()
    (tag / "checkpoint").write_text("1")
    for (t, p, e), sd in full_state_to_nxd_ep(hf, spec).items():
        params = [torch.nn.Parameter(v.clone()) for v in sd.values()]
        rank_opt = torch.optim.AdamW(params, lr=0.1)
        for n, q in zip(sd, params, strict=True):
            q.grad = shard_grads[(t, p, e)][n].clone()
        rank_opt.step()
        name = model_file(t, p, e) if ep > 1 else f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt"
        torch.save({n: q.detach() for n, q in zip(sd, params, strict=True)}, tag / "model" / name)
        torch.save(rank_opt.state_dict(), tag / "optim" / name)
    (tag / "done").write_text("1")
    return cfg, {n: q.detach() for n, q in full.items()}, want


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_plain_optimizer_per_ep_rank_converts_exactly(ep, tmp_path):
    """Expert moments follow their expert: NxD tag -> our CUDA checkpoint gives AdamW's state of the whole HF model,
    moment for moment (and the weights after the step); back to an NxD tag gives the same rank files' state."""
    from ckpt.format.reader import CheckpointReader
    from ckpt.state.training import optim_name

    cfg, weights, want = trained_tag(tmp_path / "a", "mixtral_tp2_ep2", ep)
    convert(str(tmp_path / "a"), str(tmp_path / "cuda"), ConvertOptions(to="cuda", config=cfg))
    r = CheckpointReader(str(tmp_path / "cuda"))
    for name, state in want.items():
        assert torch.equal(r.read(name), weights[name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(r.read(optim_name(name, key)), state[key]), (name, key)
    layout = {"tp": TP, "ep": ep, "qkv_linear": True}
    convert(
        str(tmp_path / "cuda"), str(tmp_path / "b"), ConvertOptions(to="neuron", format="nxd", layout=layout)
    )
    a, b = read_tag(tmp_path / "a"), read_tag(tmp_path / "b")
    assert a.per_rank_optimizer.keys() == b.per_rank_optimizer.keys() == a.per_rank_model.keys()
    for rank, oa in a.per_rank_optimizer.items():
        ob = b.per_rank_optimizer[rank]
        assert oa["param_groups"] == ob["param_groups"], rank
        assert list(oa["state"]) == list(ob["state"]), rank
        for n, per in oa["state"].items():
            for key, v in per.items():
                assert torch.equal(v, ob["state"][n][key]), (rank, n, key)


# ------------------------------------------------------------------------------------------------ refusals


def test_ep_tag_with_zero1_optimizer_without_ep_offsets_is_refused(tmp_path):
    """ZeRO-1 files beside ep_rank model files must be NeuronEPZero1Optimizer's (``ep_*_offset`` keys): a plain
    NeuronZero1Optimizer dict there cannot say which pids are experts."""
    cfg, hf, ranks = truth("mixtral_tp2_ep2")
    tag = tmp_path / "step_3"
    write_nxd_tag(tag, ranks, hf, xser=False)
    (tag / "optim").mkdir()
    for dp in range(2):
        for t in range(TP):
            d = {"state": {}, "param_groups": [{"lr": 0.1, "params": []}], "base_state": {}, "shape_info": {}}
            torch.save(d, tag / "optim" / f"dp_rank_{dp:02d}_tp_rank_{t:02d}_pp_rank_00.pt")
    out = tmp_path / "out"
    with pytest.raises(CorruptionError, match="lacks NeuronEPZero1Optimizer's ep_\\*_offset keys"):
        convert(str(tag), str(out), ConvertOptions(to="cuda", format="hf", config=cfg))
    assert not out.exists()


def test_writing_zero1_with_dp_not_a_multiple_of_ep_is_refused(tmp_path):
    cfg, _, _ = trained_tag(tmp_path / "a", "mixtral_tp2_ep2", 2)
    convert(str(tmp_path / "a"), str(tmp_path / "cuda"), ConvertOptions(to="cuda", config=cfg))
    out = tmp_path / "out"
    layout = {"tp": TP, "ep": EP, "dp": 3, "qkv_linear": True}
    with pytest.raises(LayoutError, match=r"needs --dp \(3\) a multiple of --ep \(2\)"):
        convert(str(tmp_path / "cuda"), str(out), ConvertOptions(to="neuron", format="nxd", layout=layout))
    assert not out.exists()


def test_xser_ep_rank_without_its_own_expert_file_is_refused(tmp_path):
    """NxD's loader reads a tensor not marked expert_model_parallel from ep_rank_00's folder: an EP rank whose
    expert file is missing must not silently get EP rank 0's experts."""
    cfg, hf, ranks = truth("mixtral_tp2_ep2")
    tag = tmp_path / "step_3"
    write_nxd_tag(tag, ranks, hf, xser=True)
    f = tag / "model" / model_file(1, 0, 1)
    refs = torch.load(f, weights_only=False)
    tid = refs["model.layers.0.mlp.expert_mlps.mlp_op.down_proj.weight"].tid
    Path(f"{f}.tensors/tensor_{tid}.pt").unlink()
    with pytest.raises(
        CorruptionError, match=rf"tensor_{tid}\.pt: expert tensor .*down_proj.weight of tp 1 pp 0 ep 1"
    ):
        convert(str(tag), str(tmp_path / "out"), ConvertOptions(to="cuda", format="hf", config=cfg))
    assert not (tmp_path / "out").exists()


def test_ep_rank_files_of_a_dense_model_are_refused(tmp_path):
    _, hf, ranks = truth("mixtral_tp2_ep2")
    write_nxd_tag(tmp_path / "t", ranks, hf, xser=False)
    cfg = json.loads((FIX / "llama_tp2_trn1_m1" / "hf" / "config.json").read_text())
    with pytest.raises(CkptError, match="ep_rank|rule set"):
        convert(
            str(tmp_path / "t"), str(tmp_path / "out"), ConvertOptions(to="cuda", format="hf", config=cfg)
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"model_type": "qwen3_moe", "mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] \(dense layers"),
        ({"model_type": "qwen3_moe", "decoder_sparse_step": 2}, r"decoder_sparse_step=2 \(dense layers"),
        ({"model_type": "qwen2_moe"}, r"model_type 'qwen2_moe' is not supported \(supported: .*qwen3_moe"),
    ],
)
def test_mixed_dense_sparse_layers_and_shared_experts_are_refused(extra, match, tmp_path):
    """Qwen3-MoE with dense layers between sparse ones, and Qwen2-MoE (shared expert + its gate), are refused in one
    line before anything is written (docs/layouts.md says why)."""
    cfg, hf, ranks = truth("qwen3_moe_tp2_ep2_trn1")
    write_nxd_tag(tmp_path / "t", ranks, hf, xser=False)
    with pytest.raises(LayoutError, match=match):
        convert(
            str(tmp_path / "t"),
            str(tmp_path / "out"),
            ConvertOptions(to="cuda", format="hf", config=cfg | extra),
        )
    assert not (tmp_path / "out").exists()


def zero1_shard(t: torch.Tensor, n: int, i: int) -> torch.Tensor:
    """torch_xla's ZeRO-1 rule, written out here: pad dim 0 with zeros to a multiple of ``n``, take chunk ``i``."""
    rows = -(-t.shape[0] // n) * n
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))]).chunk(n)[i].clone()


def ep_zero1_tag(tag: Path, case: str, dp: int) -> tuple[dict, dict[str, dict], dict[tuple[int, int], dict]]:
    """An NxD tag whose optimizer is NeuronEPZero1Optimizer's state after one AdamW step, built here from NxD's
    ``state_dict()`` code (zero_redundancy_optimizer.py): per DP rank ``d`` (EP rank ``d % ep``, expert-DP rank
    ``d // ep``) the non-expert optimizer's shard ``d`` of ``dp`` and the expert optimizer's shard ``d // ep`` of
    ``dp / ep``, appended under the ``ep_*_offset`` keys.  Returns the config, AdamW's state on the whole HF model
    (truth) and the files' dicts by (dp, tp)."""
    cfg, hf, _ = truth(case)
    spec = LayoutSpec.from_hf_config(cfg, tp=TP, ep=EP, qkv_linear=True, hw=CASES[case])
    g = torch.Generator().manual_seed(0)
    full = {n: torch.nn.Parameter(t.clone()) for n, t in hf.items()}
    opt = torch.optim.AdamW(list(full.values()), lr=0.1)
    for q in full.values():
        q.grad = torch.randn(q.shape, generator=g)
    opt.step()
    want = {n: opt.state[q] for n, q in full.items()}
    hyper = {k: v for k, v in opt.state_dict()["param_groups"][0].items() if k != "params"}
    weights = full_state_to_nxd_ep({n: q.detach() for n, q in full.items()}, spec)
    moments = {
        key: full_state_to_nxd_ep({n: s[key] for n, s in want.items()}, spec)
        for key in ("exp_avg", "exp_avg_sq")
    }
    (tag / "model").mkdir(parents=True)
    (tag / "optim").mkdir()
    (tag / "checkpoint").write_text("1")
    for (t, p, e), sd in weights.items():
        torch.save(sd, tag / "model" / model_file(t, p, e))
    files = {}
    for t in range(TP):
        for d in range(dp):
            k, e = d % EP, d // EP
            names = list(weights[(t, 0, k)])

            def sub(expert: bool, n_shards: int, i: int, names=names, k=k, t=t) -> dict:
                mine = [n for n in names if bool(EXPERT_STACKED.match(n)) == expert]
                base = {
                    pid: {"step": want["lm_head.weight"]["step"].clone()}
                    | {key: zero1_shard(moments[key][(t, 0, k)][n], n_shards, i) for key in moments}
                    for pid, n in enumerate(mine)
                }
                shapes = {pid: list(weights[(t, 0, k)][n].shape) for pid, n in enumerate(mine)}
                groups = [{**hyper, "params": list(range(len(mine)))}]
                return {"state": {}, "param_groups": groups, "base_state": base, "shape_info": shapes}

            a, b = sub(False, dp, d), sub(True, dp // EP, e)
            off = {"ep_param_id_offset": 1, "ep_param_group_offset": 1,  # max(key)+1 of a table, 1 when it is empty
                   "ep_base_state_offset": len(a["base_state"]), "ep_shape_info_offset": len(a["shape_info"])}  # fmt: skip
            files[(d, t)] = {
                **off,
                "param_groups": a["param_groups"] + b["param_groups"],
                "state": {},
                "base_state": {**a["base_state"], **{off["ep_base_state_offset"] + i: v for i, v in b["base_state"].items()}},
                "shape_info": {**a["shape_info"], **{off["ep_shape_info_offset"] + i: v for i, v in b["shape_info"].items()}},
            }  # fmt: skip
            torch.save(files[(d, t)], tag / "optim" / f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt")
    (tag / "done").write_text("1")
    return cfg, want, files


def without_names(d: dict) -> dict:
    """An optim file ckpt wrote, less the ``param_names`` it records in each group (one name per pid; NxD's own
    files built from unnamed parameters have none)."""
    for g in d["param_groups"]:
        assert len(g.pop("param_names")) == len(g["params"])
    return d


def same(a, b, depth: int = 0) -> bool:
    """Equal values and types; dict keys in the same order down to the pids (a pid's own state, e.g. Adam's
    ``step`` / ``exp_avg``, in any order: ckpt keeps tensors before scalars, torch.optim the other way)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        keys = (list(a) == list(b)) if depth < 2 else (sorted(map(str, a)) == sorted(map(str, b)))
        return isinstance(b, dict) and keys and all(same(v, b[k], depth + 1) for k, v in a.items())
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


@pytest.mark.parametrize("case", ["mixtral_tp2_ep2", "qwen3_moe_tp2_ep2_trn2"])
def test_ep_zero1_optimizer_converts_exactly_both_ways(case, tmp_path):
    """NeuronEPZero1Optimizer (dp 4 = ep 2 x expert-dp 2): non-expert moments merged over the 4 DP files, expert
    moments of EP rank k over DP ranks k and k+2; -> our CUDA checkpoint equals AdamW's state of the whole HF model;
    -> NxD tag (--dp 4 --ep 2) writes every optim file exactly as NxD's state_dict() made it."""
    from ckpt.format.reader import CheckpointReader
    from ckpt.state.training import optim_name

    cfg, want, files = ep_zero1_tag(tmp_path / "a", case, dp=4)
    convert(str(tmp_path / "a"), str(tmp_path / "cuda"), ConvertOptions(to="cuda", config=cfg))
    r = CheckpointReader(str(tmp_path / "cuda"))
    for name, state in want.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(r.read(optim_name(name, key)), state[key]), (name, key)
    layout = {"tp": TP, "ep": EP, "dp": 4, "qkv_linear": True, "hw": CASES[case]}
    convert(
        str(tmp_path / "cuda"), str(tmp_path / "b"), ConvertOptions(to="neuron", format="nxd", layout=layout)
    )
    got = sorted(p.name for p in (tmp_path / "b" / "optim").iterdir())
    assert got == sorted(f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt" for d, t in files)
    for (d, t), theirs in files.items():
        mine = torch.load(
            tmp_path / "b" / "optim" / f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt", weights_only=True
        )
        assert same(without_names(mine), theirs), (d, t)


def test_ep_zero1_tag_to_xser_tag_and_back_is_the_same_tag(tmp_path):
    """NxD tag -> NxD tag keeping the layout (plain -> xser -> plain, ZeRO-1 with EP): the same model and optimizer
    files, dict for dict."""
    cfg, _, files = ep_zero1_tag(tmp_path / "a", "mixtral_tp2_ep2", dp=4)
    convert(
        str(tmp_path / "a"),
        str(tmp_path / "x"),
        ConvertOptions(to="neuron", format="nxd", xser=True, config=cfg),
    )
    assert (tmp_path / "x" / "model" / f"{model_file(0, 0, 1)}.tensors").is_dir()
    convert(
        str(tmp_path / "x"),
        str(tmp_path / "b"),
        ConvertOptions(to="neuron", format="nxd", xser=False, config=cfg),
    )
    for (d, t), theirs in files.items():
        mine = torch.load(
            tmp_path / "b" / "optim" / f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt", weights_only=True
        )
        assert same(without_names(mine), theirs), (d, t)
    for t in range(TP):
        for e in range(EP):
            a = torch.load(tmp_path / "a" / "model" / model_file(t, 0, e), weights_only=True)
            assert same(torch.load(tmp_path / "b" / "model" / model_file(t, 0, e), weights_only=True), a), (
                t,
                e,
            )


ROUTER = "model.layers.0.mlp.router.linear_router.weight"


@pytest.mark.parametrize(
    "rank, change, error, match",
    [
        # a router (replicated on every rank) that differs on EP rank 1 is a desynchronised run: refused, not dropped
        (
            (1, 0, 1),
            lambda t: t + 1,
            LayoutError,
            r"linear_router\.weight of tp 1 pp 0 ep 1 differs from its copy on ep 0",
        ),
        # EP rank 1's file holds the router in another shape than EP rank 0's: named before anything is read
        (
            (0, 0, 1),
            lambda t: t[:-1].clone(),
            CorruptionError,
            r"rank tp 0 pp 0 ep 1 holds \S+linear_router\.weight \[\d+, \d+\] torch\.\w+, unlike ep 0",
        ),
    ],
)
def test_ep_rank_with_a_different_non_expert_copy_is_refused(rank, change, error, match, tmp_path):
    cfg, hf, ranks = truth("mixtral_tp2_ep2")
    ranks[rank][ROUTER] = change(ranks[rank][ROUTER])
    write_nxd_tag(tmp_path / "t", ranks, hf, xser=False)
    with pytest.raises(error, match=match):
        convert(
            str(tmp_path / "t"), str(tmp_path / "out"), ConvertOptions(to="cuda", format="hf", config=cfg)
        )
    assert not (tmp_path / "out").exists()
