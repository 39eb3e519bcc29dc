"""optimum-neuron 0.4.5's own consolidation (what ``optimum-cli neuron consolidate`` runs), unmodified, on ckpt's
``convert --to neuron --format optimum-neuron`` folders: the source's tensors come back bit for bit.

Layouts: TP 1/2/4/8, TP2 x PP2, GQA with KV replicated by NxD's ``GQAQKVColumnParallelLinear`` (``kv_size_multiplier``
2 at TP 4 and 4 at TP 8, the layout optimum-neuron builds on trn1 and trn2 alike), fused QKV (``weight_qkv`` and
the stride-3 MHA ``qkv_proj``), xser and plain ``torch.save`` shards; Llama and Qwen3, the families optimum-neuron
0.4.5 has training models for that ckpt knows (it has none for Qwen2, Mistral or Mixtral: those are refused).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _tiny_models import write_model, write_tokenizer, write_training_args
from ckpt.converters.convert import ConvertOptions, RunOptions, convert
from safetensors.torch import load_file

from ckpt.errors import LayoutError

# id: (model, tp, pp, extra options, dtype); shards are plain torch.save files unless "xser" (optimum-neuron's default,
# one file per tensor) is asked
CASES: dict[str, tuple[str, int, int, dict[str, Any], torch.dtype]] = {
    "llama_tp1": ("llama_gqa", 1, 1, {}, torch.float32),
    "llama_tp2_xser": ("llama_gqa", 2, 1, {"xser": True}, torch.float32),
    "llama_tp4_kvx2": ("llama_gqa", 4, 1, {}, torch.float32),
    "llama_tp8_kvx4": ("llama_gqa", 8, 1, {}, torch.float32),
    "llama_tp8_kvx4_fused_bf16": ("llama_gqa", 8, 1, {"fuse_qkv": True}, torch.bfloat16),
    "llama_tp2_pp2_xser": ("llama_gqa", 2, 2, {"xser": True}, torch.float32),
    "llama_tp4_pp2_kvx2": ("llama_gqa", 4, 2, {}, torch.float32),
    "llama_mha_tp2_fused": ("llama_mha", 2, 1, {"fuse_qkv": True}, torch.float32),
    "llama_mha_tp4": ("llama_mha", 4, 1, {}, torch.float32),
    "qwen3_tp2": ("qwen3_gqa", 2, 1, {}, torch.float32),
    "qwen3_tp4_kvx2_xser": ("qwen3_gqa", 4, 1, {"xser": True}, torch.float32),
    "qwen3_tp8_pp2_kvx4_fused": ("qwen3_gqa", 8, 2, {"fuse_qkv": True}, torch.float32),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, torch.dtype], Path]:
    base = tmp_path_factory.mktemp("src")
    wanted = {(m, d) for m, _, _, _, d in CASES.values()}
    return {(m, d): write_model(m, base / f"{m}_{str(d)[6:]}", dtype=d) for m, d in sorted(wanted, key=str)}


def export(src: Path, dst: Path, tp: int, pp: int, **extra: Any) -> Path:
    xser = extra.pop("xser", False)
    convert(str(src), str(dst), ConvertOptions.neuron(format="optimum-neuron", tp=tp, pp=pp, xser=xser, **extra),
            RunOptions())  # fmt: skip
    return dst


def consolidate(folder: Path, out: Path) -> dict[str, torch.Tensor]:
    from optimum.neuron.models.training.checkpointing import (
        consolidate_model_parallel_checkpoints_to_unified_checkpoint,
    )

    consolidate_model_parallel_checkpoints_to_unified_checkpoint(folder, out)
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    return got


@pytest.mark.parametrize("case", list(CASES))
def test_optimum_neuron_consolidation_gives_back_the_source_bit_for_bit(
    sources: dict[tuple[str, torch.dtype], Path], tmp_path: Path, case: str
) -> None:
    model, tp, pp, extra, dtype = CASES[case]
    src = sources[(model, dtype)]
    folder = export(src, tmp_path / "checkpoint-0", tp, pp, **extra)
    assert sorted(p.name for p in (folder / "shards").glob("mp_metadata_pp_rank_*.json")) == [
        f"mp_metadata_pp_rank_{p}.json" for p in range(pp)
    ]
    got, want = consolidate(folder, tmp_path / "out"), load_file(src / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    trn = json.loads((folder / "trn_config.json").read_text())
    assert (trn["tensor_parallel_size"], trn["pipeline_parallel_size"]) == (tp, pp)
    assert trn["use_xser"] is extra.get("xser", False)


def test_the_kv_size_multiplier_recorded_is_the_one_the_files_hold(
    sources: dict[tuple[str, torch.dtype], Path], tmp_path: Path
) -> None:
    """TP 8 over 2 KV heads: optimum-neuron's rule (max(1, tp // kv)) gives 4; the metadata and trn_config say 4,
    and each rank's K rows are one head's (8 rows of head_dim 8)."""
    folder = export(sources[("llama_gqa", torch.float32)], tmp_path / "c", 8, 1, xser=False)
    meta = json.loads((folder / "shards" / "mp_metadata_pp_rank_0.json").read_text())
    spec = meta["model_weight_transformation_specs"][0]["specs"][0]
    assert spec[0] == "GQAQKVColumnParallelLinearSpec" and spec[1]["kv_size_multiplier"] == 4
    assert json.loads((folder / "trn_config.json").read_text())["kv_size_multiplier"] == 4
    shard = torch.load(folder / "shards" / "model" / "dp_rank_00_tp_rank_07_pp_rank_00.pt", weights_only=True)
    assert shard["model.layers.0.self_attn.qkv_proj.weight_k"].shape == (8, 64)


def test_training_args_and_tokenizer_files_are_copied_byte_for_byte(
    sources: dict[tuple[str, torch.dtype], Path], tmp_path: Path
) -> None:
    src = tmp_path / "src"
    shutil.copytree(sources[("llama_gqa", torch.float32)], src)
    write_tokenizer(src)
    write_training_args(src)
    folder = export(src, tmp_path / "checkpoint-0", 2, 1)
    copied = sorted(
        p.name
        for p in src.iterdir()
        if p.name not in ("model.safetensors", "config.json", "generation_config.json")
    )
    assert "training_args.bin" in copied and "tokenizer.json" in copied, copied
    for name in copied:
        assert (folder / name).read_bytes() == (src / name).read_bytes(), name
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(folder)("w3 w5")["input_ids"] == [3, 5]
    args = torch.load(
        folder / "training_args.bin", weights_only=False
    )  # the test's own file, read as the Trainer
    assert (args.learning_rate, args.seed) == (3e-4, 7)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"hw": "trn2"}, "tiles KV copies"),
        ({"qkv_linear": False}, "uses GQAQKVColumnParallelLinear"),
        ({"kv_size_multiplier": 2, "tp": 2}, "replicates no KV head"),
    ],
)
def test_a_layout_optimum_neuron_would_read_wrong_is_refused(
    sources: dict[tuple[str, torch.dtype], Path], tmp_path: Path, extra: dict[str, Any], says: str
) -> None:
    tp = extra.pop("tp", 4)
    with pytest.raises(LayoutError, match=says):
        export(sources[("llama_gqa", torch.float32)], tmp_path / "c", tp, 1, **extra)
    assert not (tmp_path / "c").exists()


def test_a_model_optimum_neuron_cannot_train_is_refused(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=48, num_attention_heads=4,
                               num_key_value_heads=2, num_hidden_layers=1, vocab_size=32)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "qwen2")
    with pytest.raises(LayoutError, match="no training model for model_type 'qwen2'"):
        export(tmp_path / "qwen2", tmp_path / "c", 2, 1)


def test_reading_our_folder_back_with_another_kv_order_is_refused(
    sources: dict[tuple[str, torch.dtype], Path], tmp_path: Path
) -> None:
    """The folder holds optimum-neuron's (trn1) KV order whatever chip it trains on: --source-hw trn2 would read
    the wrong heads, so it is refused; without it the folder reads back to the source."""
    src = sources[("llama_gqa", torch.float32)]
    folder = export(src, tmp_path / "c", 4, 1)
    with pytest.raises(LayoutError, match="--source-hw trn2"):
        convert(str(folder), str(tmp_path / "hf"), ConvertOptions(to="cuda", format="hf", source_flags={"hw": "trn2"}),
                RunOptions())  # fmt: skip
    convert(str(folder), str(tmp_path / "hf"), ConvertOptions(to="cuda", format="hf"), RunOptions())
    got = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    want = load_file(src / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
