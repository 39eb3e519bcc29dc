"""What the save-time facts cost (``ckpt.state.save_facts``) against the save they are taken for.

Run: ``.venv/bin/python bench/save_facts_cost.py [--layers 10] [--device cpu|cuda]``.  Builds a Llama-shaped
model of ~120M parameters (hidden 768, 10 layers, vocabulary 32000, untied head: ~93 tensors), then times, as the
median of ``--repeat`` runs: the weight fingerprint (:func:`weights_sample`), the RNG digests
(:func:`rng_digests`), and a ``CheckpointManager`` save with and without a listener (the listener is what makes
the manager take the facts): the blocking time of an async save and the whole of a synchronous one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

from ckpt import CheckpointManager
from ckpt.state.save_facts import rng_digests, weights_sample


def _model(layers: int, device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=12,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).to(device)


def _median(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    model = _model(args.layers, args.device)
    params = sum(p.numel() for p in model.parameters())
    tensors = len(model.state_dict())
    fp = _median(lambda: weights_sample(model), args.repeat)
    rng = _median(rng_digests, args.repeat)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for listener in (False, True):
            events: list[dict] = []
            on_event = (lambda k, i, ev=events: ev.append(i) if k == "save" else None) if listener else None
            for async_save in (True, False):
                mgr = CheckpointManager(
                    f"{tmp}/{listener}-{async_save}", async_save=async_save, on_event=on_event, keep_last=1
                )
                blocking, total = [], []
                for step in range(args.repeat):
                    t0 = time.perf_counter()
                    mgr.save(step, model=model)
                    blocking.append(time.perf_counter() - t0)
                    mgr.wait()
                    total.append(time.perf_counter() - t0)
                mgr.close()
                rows[listener, async_save] = (statistics.median(blocking), statistics.median(total))
            if listener:
                facts = statistics.median(e["facts_s"] for e in events)
    print(f"model: {params / 1e6:.1f}M parameters, {tensors} tensors, on {args.device}")
    print(f"weights_sample: {1e3 * fp:.2f} ms median of {args.repeat}; rng_digests: {1e3 * rng:.3f} ms")
    print(f"facts taken inside CheckpointManager.save (facts_s): {1e3 * facts:.2f} ms")
    for (listener, async_save), (b, t) in rows.items():
        kind = "async" if async_save else "sync"
        print(
            f"{kind} save, {'with' if listener else 'without'} a listener: call returns after {1e3 * b:.1f} ms "
            f"(training blocked), committed after {1e3 * t:.1f} ms"
        )


if __name__ == "__main__":
    main()
