"""NxD's own training Llama on ckpt's shards: ``ckpt convert --format nxd`` of a Hugging Face Llama (trn1 and trn2,
``kv_size_multiplier`` 2 and 4), loaded by NxD's ``load_checkpoint`` into ``examples/training/llama/
modeling_llama_nxd.py``'s ``LlamaForCausalLM`` (``GQAQKVColumnParallelLinear``, ``ColumnParallelLinear`` /
``RowParallelLinear`` / ``ParallelEmbedding``, its ``CoreAttention``), built by NxD's ``initialize_parallel_model``
on 4 gloo ranks, gives the logits of transformers' ``LlamaForCausalLM`` on the source model.

The main suite proves the same head pairing with a forward written in the test from the rank shards
(``tests/test_layouts_functional.py::tp_forward``, also run on converter output by
``tests/test_convert_functional.py``), for more layouts than run here; this test is the stack's own model on them.
The example model needs transformers 4.48 (its ``requirements.txt``; it imports ``LLAMA_INPUTS_DOCSTRING`` and
indexes decoder-layer outputs as tuples, both gone by 4.57), so the rank processes put the pip ``--target`` folder
``.venv-trainium/nxd-site`` (``nxd-site-requirements.txt``) ahead of the environment's transformers 4.57;
the reference logits come from 4.57 in this process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import conftest
import pytest
import torch
from _nxd_launch import run_ranks
from ckpt.cli.main import cli
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

RANKS = 4
ATOL = 2e-5  # float32 on both sides; a wrong head pairing moves logits by ~1e-1 (the negative case below)
# name: (KV heads, --kv-size-multiplier): with 8 query heads, KV heads x multiplier = the TP degree, 4
MODELS = {"m2": (2, 2), "m4": (1, 4)}


def _model(kv: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32, num_attention_heads=8, num_key_value_heads=kv, num_hidden_layers=2, vocab_size=64,
        intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to one: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _save_for_nxd(model: LlamaForCausalLM, folder: Path) -> None:
    """The HF folder (ckpt's SRC), whose ``config.json`` is also the example's ``--model_path`` config.  transformers
    4.57 records the dtype as ``dtype``, which 4.48 does not read (``torch_dtype`` None): NxD's ``ParallelEmbedding``
    then rounds its TP>1 output to bf16 (``parallel_layers/layers.py:359-363``).  NxD's example configs say
    ``torch_dtype`` (``tp_zero1_llama_hf_pretrain/8B_config_llama3/config.json``); so does this one."""
    model.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, torch_dtype=cfg["dtype"])))


def _convert(src: Path, dst: Path, *flags: str) -> None:
    """``ckpt convert SRC DST --to neuron --format nxd ...``, the command line in this process."""
    res = CliRunner().invoke(
        cli, ["convert", str(src), str(dst), "--to", "neuron", "--format", "nxd", *flags]
    )
    assert res.exit_code == 0, res.output


def _logits(out: Path) -> torch.Tensor:
    return torch.cat(
        [load_file(str(out / f"logits_tp{r}.safetensors"))["logits"] for r in range(RANKS)], dim=-1
    )


def _swap_kv_ranks(tag: Path, a: int, b: int) -> None:
    """Give TP ranks ``a`` and ``b`` each other's K and V shards (a wrong head pairing); the files are NxD's."""
    files = [tag / "model" / f"dp_rank_00_tp_rank_{r:02d}_pp_rank_00.pt" for r in (a, b)]
    sds = [torch.load(f, weights_only=True) for f in files]
    for name in [n for n in sds[0] if n.endswith(("weight_k", "weight_v"))]:
        sds[0][name], sds[1][name] = sds[1][name], sds[0][name]
    for f, sd in zip(files, sds, strict=True):
        torch.save(sd, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Every case in one launch of the rank processes (their start, not the cases, is what costs): each model
    converted for trn1 and trn2, and the negative case; HF's logits for each model."""
    tmp = tmp_path_factory.mktemp("nxd_llama")
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    cases, expected = [], {}
    for name, (kv, mult) in MODELS.items():
        model = _model(kv, seed=kv)
        _save_for_nxd(model, tmp / f"hf_{name}")
        with torch.no_grad():
            expected[name] = model(ids).logits
        for hw in ("trn1", "trn2"):
            tag = f"{hw}_{name}"
            _convert(tmp / f"hf_{name}", tmp / "ckpts" / tag, "--tp", str(RANKS), "--qkv-linear",
                     "--kv-size-multiplier", str(mult), "--hw", hw)  # fmt: skip
            cases.append(dict(
                name=tag, platform=hw, kv_size_multiplier=mult, config_dir=str(tmp / f"hf_{name}"),
                path=str(tmp / "ckpts"), tag=tag, out=str(tmp / "out" / tag),
            ))  # fmt: skip
    # the check can fail: trn2_m2 with TP ranks 0 and 3's K/V shards swapped pairs query heads with wrong KV heads
    shutil.copytree(tmp / "ckpts" / "trn2_m2", tmp / "ckpts" / "swapped")
    _swap_kv_ranks(tmp / "ckpts" / "swapped", 0, RANKS - 1)
    cases.append(dict(cases[1], name="swapped", tag="swapped", out=str(tmp / "out" / "swapped")))
    job = dict(
        ids=ids.tolist(), cases=cases, llama_example=str(conftest.NXD_ROOT / "examples/training/llama")
    )
    run_ranks("_nxd_llama_ranks.py", job, tmp, RANKS)
    return tmp / "out", expected


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("hw", ["trn1", "trn2"])
def test_nxd_training_llama_on_ckpt_shards_gives_hf_logits(runs, hw: str, model: str) -> None:
    out, expected = runs
    torch.testing.assert_close(_logits(out / f"{hw}_{model}"), expected[model], atol=ATOL, rtol=0)


def test_wrong_head_pairing_changes_the_logits(runs) -> None:
    out, expected = runs
    assert (_logits(out / "swapped") - expected["m2"]).abs().max() > 100 * ATOL
