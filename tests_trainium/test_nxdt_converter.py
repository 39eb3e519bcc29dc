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
    "import sys; from neuronx_distributed.scripts.checkpoint_converter import CheckpointConverterBase as C; "
    "c = C(); c.run(c.get_arg_parser().parse_args(sys.argv[1:]))"
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


def _nxdt_converter(*args: str) -> None:
    """NxD Training's checkpoint_converter.py with these arguments, in a fresh process (NxD's trainer importable)."""
    r = subprocess.run(
        [sys.executable, "-c", CONVERTER, *args], env=site_env(), capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr[-3000:]


def _ckpt(*args: str):
    return CliRunner().invoke(cli, ["convert", *args])


@pytest.mark.parametrize("hw,kv,tp,mult", [("trn1", 2, 2, 1), ("trn1", 2, 4, 2), ("trn2", 2, 4, 2)])
def test_nxdt_converter_reads_our_nxdt_tag(hw: str, kv: int, tp: int, mult: int, tmp_path: Path) -> None:
    model = _model(kv)
    model.save_pretrained(tmp_path / "hf")
    tag = tmp_path / "exp" / "checkpoints" / TAG
    res = _ckpt(str(tmp_path / "hf"), str(tag), "--to", "neuron", "--format", "nxdt", "--tp", str(tp), "--qkv-linear",
                "--kv-size-multiplier", str(mult), "--hw", hw, "--step", "5", "--consumed-samples", "40")  # fmt: skip
    assert res.exit_code == 0, res.output
    _nxdt_converter(
        "--model_style", "hf", "--convert_to_full_state", "--input_dir", str(tag / "model"),
        "--output_dir", str(tmp_path / "full"), "--config", str(tmp_path / "hf" / "config.json"),
        "--tp_size", str(tp), "--qkv_linear", "True", "--kv_size_multiplier", str(mult), "--hw_backend", hw,
        "--n_layers", "2",
    )  # fmt: skip
    full = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)
    source = model.state_dict()
    assert set(full) == set(source)
    differ = sorted(n for n in source if not torch.equal(full[n], source[n]))
    if hw == "trn1" or mult == 1:
        assert differ == []
    else:  # NxD's converter reads trn2 K/V with the trn1 tiling (module docstring); nothing else differs
        assert differ == [f"model.layers.{n}.self_attn.{p}_proj.weight" for n in range(2) for p in "kv"]
        hd = 4
        for n in range(
            2
        ):  # what it returns: TP ranks 0 and 1's K heads, which ckpt's trn2 tag replicates (K0, K0)
            k = source[f"model.layers.{n}.self_attn.k_proj.weight"]
            assert torch.equal(full[f"model.layers.{n}.self_attn.k_proj.weight"], torch.cat([k[:hd], k[:hd]]))


@pytest.mark.parametrize("kv,qkv_linear", [(2, "True"), (8, "False")])
def test_megatron_style_tag_is_refused(kv: int, qkv_linear: str, tmp_path: Path) -> None:
    model = _model(kv)
    model.save_pretrained(tmp_path / "hf")
    torch.save(
        model.state_dict(), tmp_path / "checkpoint.pt"
    )  # the converter's --input_dir (a full state dict)
    tag = tmp_path / "exp" / "checkpoints" / TAG
    _nxdt_converter(
        "--model_style", "megatron", "--convert_from_full_state", "--input_dir", str(tmp_path / "checkpoint.pt"),
        "--output_dir", str(tag), "--config", str(tmp_path / "hf" / "config.json"), "--tp_size", "2",
        "--qkv_linear", qkv_linear, "--kv_size_multiplier", "1", "--hw_backend", "trn1", "--n_layers", "2",
    )  # fmt: skip
    for r in range(2):
        shard = torch.load(tag / "model" / f"dp_rank_00_tp_rank_{r:02d}_pp_rank_00.pt", weights_only=True)
        assert set(shard) == MEGATRON_NAMES
    res = _ckpt(str(tag), str(tmp_path / "out"), "--to", "cuda", "--format", "hf", "--config",
                str(tmp_path / "hf" / "config.json"))  # fmt: skip
    assert res.exit_code != 0
    assert "language_model." in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "out").exists()
