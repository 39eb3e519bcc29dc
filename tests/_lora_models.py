"""Tiny PEFT LoRA models (Llama and Qwen2 families) with non-zero random adapters, for the LoRA tests.

``shared_a`` ties lora_A where NxD keeps one matrix for several HF modules: gate/up always (NxD's Llama fuses them
into ``gate_up_proj``), and q/k/v too when ``"qkv"`` is in it (``GQAQKVColumnParallelLinear``).
"""

from __future__ import annotations

from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_config(family: str, dtype: torch.dtype = torch.float32):  # noqa: ANN201 - transformers config
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=96, max_position_embeddings=64, dtype=dtype,
    )  # fmt: skip
    if family == "llama":
        return LlamaConfig(**common)
    return Qwen2Config(**common)


def build(family: str, *, seed: int = 0, shared: tuple[str, ...] = ("mlp",), r: int = 4, rslora: bool = False,
          dtype: torch.dtype = torch.float32):  # fmt: skip  # noqa: ANN201
    """A PEFT model over a random tiny base, every adapter matrix random (B too, unlike PEFT's zero init)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(tiny_config(family, dtype), dtype=dtype)
    model = get_peft_model(
        base, LoraConfig(r=r, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, use_rslora=rslora)
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.1)
        for layer in model.base_model.model.model.layers:
            if "mlp" in shared:
                layer.mlp.up_proj.lora_A["default"].weight.copy_(layer.mlp.gate_proj.lora_A["default"].weight)
            if "qkv" in shared:
                a = layer.self_attn.q_proj.lora_A["default"].weight
                layer.self_attn.k_proj.lora_A["default"].weight.copy_(a)
                layer.self_attn.v_proj.lora_A["default"].weight.copy_(a)
    model.eval()
    return model


def save(model, root: Path) -> tuple[Path, Path]:  # noqa: ANN001
    """``(base_dir, adapter_dir)``: the base as an HF folder, the adapter as a PEFT folder."""
    from peft import get_peft_model_state_dict

    base_dir, adapter_dir = root / "base", root / "adapter"
    base = model.get_base_model()
    sd = {k: v for k, v in base.state_dict().items() if "lora_" not in k}
    clean = {k.replace(".base_layer", ""): v for k, v in sd.items()}
    fresh = type(base)(base.config)
    fresh.load_state_dict(clean, strict=False)
    fresh.to(base.dtype).save_pretrained(base_dir)
    model.save_pretrained(adapter_dir)
    assert set(get_peft_model_state_dict(model))
    return base_dir, adapter_dir


def logits(model, seed: int = 7) -> torch.Tensor:  # noqa: ANN001
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits
