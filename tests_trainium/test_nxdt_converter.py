"""NxD Training's own checkpoint converter on ckpt's ``--format nxdt`` tags, and on its Megatron-style output.

NxD Training (aws-neuron/neuronx-distributed-training @ 9169aa0, "Neuron SDK Release 2.26.0") converts its
checkpoints with ``examples/checkpoint_converter_scripts/checkpoint_converter.py``, whose whole body is
``CheckpointConverterBase().run(CheckpointConverterBase().get_arg_parser().parse_args())`` from NxD's
``neuronx_distributed.scripts.checkpoint_converter`` (NxD 2.29 here, vendored); its docstring's commands
(``--model_style hf|megatron``, ``--convert_to_full_state --input_dir <exp>/checkpoints/<tag>.ckpt/model``) are
run here as that script runs them, in a fresh process.  NxD Training's Lightning side (``NLPCheckpointIO``) does not
import on this stack (tests_trainium/README.md, "NxD Training"), so its loader is not run.

Proven: the converter reads ckpt's nxdt tag back to the source's tensors bit for bit (trn1, ``kv_size_multiplier``
1 and 2); on trn2 with KV replication it reads the K/V shards with the trn1 tiling (its ``full_p.repeat`` rule,
``checkpoint_converter.py:567-568``, for both platforms), while ckpt's trn2 tags follow NxD's trn2 model
(test_nxd_llama_model.py), so exactly K and V differ.  The Megatron-style names the converter writes
(``--model_style megatron``, ``rename_keys_for_megatron`` / ``modify_qkv_for_megatron``) are pinned, and ckpt
refuses such a tag in one line, writing nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _nxd_launch import site_env
from ckpt.cli.main import cli
from click.testing import CliRunner
from transformers import LlamaConfig, LlamaForCausalLM

# NxD Training's checkpoint_converter.py, as a command
CONVERTER = (
    "import json, sys; from neuronx_distributed.scripts.checkpoint_converter import CheckpointConverterBase as C\n"
    "for argv in json.loads(sys.argv[1]):\n    c = C(); c.run(c.get_arg_parser().parse_args(argv))"
)
TAG = "tiny--step=5-consumed_samples=40.0.ckpt"
# What --model_style megatron writes (TP 2), GQA with --qkv_linear True and MHA without alike: Q in query, each
# rank's K and V rows concatenated in key_value (no query_key_value, which only its reverse renaming maps)
MEGATRON_NAMES = {
    "language_model.embedding.word_embeddings.weight", "language_model.encoder.final_layernorm.weight",
    "language_model.output_layer.weight",
} | {
    f"language_model.encoder.layers.{n}.{s}.weight"
    for n in range(2)
    for s in ("input_layernorm", "post_attention_layernorm", "self_attention.query", "self_attention.key_value",
              "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
}  # fmt: skip


def _model(kv: int) -> LlamaForCausalLM:
    torch.manual_seed(kv)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, num_attention_heads=8, num_key_value_heads=kv, num_hidden_layers=2, vocab_size=64,
        intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=False,
    ))  # fmt: skip


def _nxdt_converter(runs: list[list[str]]) -> None:
    """NxD Training's checkpoint_converter.py once per argument list, in one fresh process (NxD's trainer
    importable); each run parses its own arguments as the script does."""
    r = subprocess.run(
        [sys.executable, "-c", CONVERTER, json.dumps(runs)], env=site_env(), capture_output=True, text=True, timeout=240
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]


def _ckpt(*args: str):
    return CliRunner().invoke(cli, ["convert", *args])


READ_BACK = [("trn1", 2, 1), ("trn1", 4, 2), ("trn2", 4, 2)]  # (hw, tp, kv_size_multiplier), 2 KV heads
MEGATRON = [(2, "True"), (8, "False")]  # (KV heads, --qkv_linear)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, LlamaForCausalLM]]:
    """ckpt's nxdt tags read back by the converter (``read_<i>/full``), and the converter's Megatron-style tags of
    the source models (``megatron_<i>/exp/checkpoints/<TAG>``): all converter runs in one process."""
    tmp = tmp_path_factory.mktemp("nxdt_converter")
    models = {kv: _model(kv) for kv in (2, 8)}
    for kv, model in models.items():
        model.save_pretrained(tmp / f"hf{kv}")
        torch.save(model.state_dict(), tmp / f"hf{kv}" / "checkpoint.pt")  # the converter's full-state input
    runs = []
    for i, (hw, tp, mult) in enumerate(READ_BACK):
        tag = tmp / f"read_{i}" / "exp" / "checkpoints" / TAG
        res = _ckpt(str(tmp / "hf2"), str(tag), "--to", "neuron", "--format", "nxdt", "--tp", str(tp), "--qkv-linear",
                    "--kv-size-multiplier", str(mult), "--hw", hw, "--step", "5", "--consumed-samples", "40")  # fmt: skip
        assert res.exit_code == 0, res.output
        runs.append([
            "--model_style", "hf", "--convert_to_full_state", "--input_dir", str(tag / "model"),
            "--output_dir", str(tmp / f"read_{i}" / "full"), "--config", str(tmp / "hf2" / "config.json"),
            "--tp_size", str(tp), "--qkv_linear", "True", "--kv_size_multiplier", str(mult), "--hw_backend", hw,
            "--n_layers", "2",
        ])  # fmt: skip
    for i, (kv, qkv_linear) in enumerate(MEGATRON):
        runs.append([
            "--model_style", "megatron", "--convert_from_full_state", "--input_dir", str(tmp / f"hf{kv}" / "checkpoint.pt"),
            "--output_dir", str(tmp / f"megatron_{i}" / "exp" / "checkpoints" / TAG),
            "--config", str(tmp / f"hf{kv}" / "config.json"), "--tp_size", "2", "--qkv_linear", qkv_linear,
            "--kv_size_multiplier", "1", "--hw_backend", "trn1", "--n_layers", "2",
        ])  # fmt: skip
    _nxdt_converter(runs)
    return tmp, models


@pytest.mark.parametrize("i", range(len(READ_BACK)), ids=[f"{h}-tp{t}-m{m}" for h, t, m in READ_BACK])
def test_nxdt_converter_reads_our_nxdt_tag(converted, i: int) -> None:
    tmp, models = converted
    hw, _, mult = READ_BACK[i]
    full = torch.load(tmp / f"read_{i}" / "full" / "checkpoint.pt", weights_only=True)
    source = models[2].state_dict()
    assert set(full) == set(source)
    differ = sorted(n for n in source if not torch.equal(full[n], source[n]))
    if hw == "trn1" or mult == 1:
        assert differ == []
    else:  # NxD's converter reads trn2 K/V with the trn1 tiling (module docstring); nothing else differs
        assert differ == [f"model.layers.{n}.self_attn.{p}_proj.weight" for n in range(2) for p in "kv"]
        hd = 4
        for n in range(2):  # it returns TP ranks 0 and 1's K heads, which ckpt's trn2 tag holds as (K0, K0)
            k = source[f"model.layers.{n}.self_attn.k_proj.weight"]
            assert torch.equal(full[f"model.layers.{n}.self_attn.k_proj.weight"], torch.cat([k[:hd], k[:hd]]))


@pytest.mark.parametrize("i", range(len(MEGATRON)), ids=[f"kv{kv}-qkv_linear{q}" for kv, q in MEGATRON])
def test_megatron_style_tag_is_refused(converted, i: int) -> None:
    tmp, _ = converted
    kv = MEGATRON[i][0]
    tag = tmp / f"megatron_{i}" / "exp" / "checkpoints" / TAG
    for r in range(2):
        shard = torch.load(tag / "model" / f"dp_rank_00_tp_rank_{r:02d}_pp_rank_00.pt", weights_only=True)
        assert set(shard) == MEGATRON_NAMES
    out = tmp / f"megatron_{i}" / "out"
    res = _ckpt(
        str(tag), str(out), "--to", "cuda", "--format", "hf", "--config", str(tmp / f"hf{kv}" / "config.json")
    )
    assert res.exit_code != 0
    assert "language_model." in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not out.exists()
