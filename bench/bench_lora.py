"""LoRA run: adapter-only saves vs saving everything, in the same run on the same model.

    .venv/bin/python bench/bench_lora.py [--hidden 1024] [--layers 8] [--rank 16] [--repeat 3] [--dir /tmp/ckpt-lora]

A Llama-shaped base (bf16, frozen) with PEFT LoRA rank --rank on q/k/v/o/gate/up/down (fp32 adapters, AdamW over
them, one optimizer step taken).  Each repeat saves synchronously, one fresh checkpoint folder per save:

* full: ``ckpt.save(model=..., optimizer=...)`` (base + adapter + Adam moments);
* adapter, first: ``save(..., adapter_only=True)`` with a new Checkpointer (hashes the base once);
* adapter: later saves of the same Checkpointer (base digest cached).

Reports bytes written (manifest total) and the save stall (``SaveResult.total_s``: a synchronous save stalls training
for all of it; medians, or minima with --stat best on a noisy shared machine), and their ratios.  Writes
bench/results/lora.json and prints it as the last JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch

from ckpt import SaveOptions

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def build(hidden: int, layers: int, rank: int, base_dtype: torch.dtype = torch.bfloat16):  # noqa: ANN201
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256), num_hidden_layers=layers, vocab_size=32000,
    )  # fmt: skip
    base = LlamaForCausalLM(cfg).to(base_dtype)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stat", choices=["median", "best"], default="median")
    ap.add_argument("--dir", default="/tmp/ckpt-bench-lora")
    args = ap.parse_args()

    import ckpt
    from ckpt.saving.checkpointer import Checkpointer

    stat = statistics.median if args.stat == "median" else min
    model, opt = build(args.hidden, args.layers, args.rank)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    lora_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    times: dict[str, list[float]] = {"full": [], "adapter_first": [], "adapter": []}
    nbytes: dict[str, int] = {}
    step = 0

    def path() -> str:
        nonlocal step
        step += 1
        return os.path.join(args.dir, f"step_{step:08d}")

    for _ in range(args.repeat):
        r = ckpt.save(path(), step=step, model=model, optimizer=opt)
        times["full"].append(r.total_s)
        nbytes["full"] = r.bytes_written
        saver = Checkpointer()
        r = saver.save(
            path(), step=step, model=model, optimizer=opt, options=SaveOptions(adapter_only=True)
        ).result()
        times["adapter_first"].append(r.total_s)
        for _ in range(2):
            r = saver.save(
                path(), step=step, model=model, optimizer=opt, options=SaveOptions(adapter_only=True)
            ).result()
            times["adapter"].append(r.total_s)
        nbytes["adapter"] = r.bytes_written
        shutil.rmtree(args.dir)
        os.makedirs(args.dir)
    shutil.rmtree(args.dir, ignore_errors=True)
    s = {k: stat(v) for k, v in times.items()}
    out = {
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "lora_rank": args.rank,
            "base_bytes": base_bytes,
            "adapter_bytes": lora_bytes,
        },  # fmt: skip
        "bytes_written": nbytes,
        "stall_s": s,
        "ratios": {
            "bytes_full_over_adapter": nbytes["full"] / nbytes["adapter"],
            "stall_full_over_adapter": s["full"] / s["adapter"],
            "stall_full_over_adapter_first": s["full"] / s["adapter_first"],
        },
        "stat": args.stat,
        "repeat": args.repeat,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "lora.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
