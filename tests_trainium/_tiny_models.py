"""Tiny HF source models for the Trainium-stack tests (hidden 64, 2 layers), written by transformers' own
``save_pretrained``; with a tokenizer (``PreTrainedTokenizerFast.save_pretrained``) and the ``training_args.bin`` the
HF Trainer writes (``torch.save(args)``, transformers ``Trainer._save``) where asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: name: (model_type, config keywords)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_gqa": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2}),
    "llama_mha": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 8}),
    "qwen3_gqa": ("qwen3", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8}),
}
COMMON = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 64,
    "max_position_embeddings": 64, "tie_word_embeddings": False,
}  # fmt: skip


def hf_config(name: str) -> Any:
    from transformers import AutoConfig

    model_type, kw = MODELS[name]
    return AutoConfig.for_model(model_type, **COMMON, **kw)


def write_model(name: str, dst: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """A randomly initialised model ``name`` saved at ``dst`` (safetensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(name), torch_dtype=dtype)
    model.save_pretrained(dst)
    return dst


def write_tokenizer(dst: Path) -> None:
    """A word-level tokenizer over the model's 64 ids, saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(60)} | {"<unk>": 60, "<s>": 61, "</s>": 62, "<pad>": 63}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(dst)


def write_training_args(dst: Path) -> None:
    """``training_args.bin`` as the HF Trainer writes it: ``torch.save(TrainingArguments)``."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(dst / "run"), learning_rate=3e-4, seed=7, report_to=[])
    torch.save(args, dst / "training_args.bin")
