"""A tiny Llama trained by Hugging Face ``Trainer`` with ``CkptCallback``: SIGKILL it, resume it, verify it.

::

    python examples/hf_trainer.py --out runs/hf --steps 20 --kill-at 12     # dies after step 12
    python examples/hf_trainer.py --out runs/hf --steps 20 --resume         # resume_from_checkpoint=True
    ckpt verify-resume runs/hf                                             # ledger + checkpoint-N facts

The only ckpt line in the training code is ``callbacks=[CkptCallback()]``.  Runs on CPU (``use_cpu=True``,
``USE_TORCH_XLA=0`` keeps a torch-xla install out of it), one thread and ``full_determinism``, so a correct
resume reproduces the uninterrupted run's losses bit for bit.  ``--kill-at`` kills the process right after
that step (after the Trainer has written its checkpoint when the step is a save step).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

os.environ.setdefault("USE_TORCH_XLA", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

VOCAB, SEQ, N_SEQ = 64, 16, 256


def corpus(seed: int) -> list[dict[str, torch.Tensor]]:
    """N_SEQ sequences of a fixed sparse Markov chain: learnable, so the loss falls, and fully determined."""
    rs = np.random.RandomState(seed)
    nxt = rs.randint(0, VOCAB, size=(VOCAB, 3))
    seqs = np.empty((N_SEQ, SEQ), dtype=np.int64)
    seqs[:, 0] = rs.randint(0, VOCAB, size=N_SEQ)
    for j in range(1, SEQ):
        seqs[:, j] = nxt[seqs[:, j - 1], rs.randint(0, 3, size=N_SEQ)]
    return [{"input_ids": torch.from_numpy(s), "labels": torch.from_numpy(s)} for s in seqs]


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def training_args(out: str, steps: int, save_every: int, seed: int, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(**extra,
        output_dir=out, max_steps=steps, save_steps=save_every, logging_steps=1, per_device_train_batch_size=8,
        learning_rate=3e-3, warmup_steps=5, lr_scheduler_type="cosine", weight_decay=0.01, seed=seed,
        data_seed=seed, full_determinism=True, use_cpu=True, report_to=[], dataloader_num_workers=0,
        save_total_limit=None, disable_tqdm=True,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from transformers import Trainer, TrainerCallback

    from ckpt.integrations.transformers import CkptCallback

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="Trainer output_dir (ledger.jsonl and checkpoint-N)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=0, help="SIGKILL right after this step")
    p.add_argument(
        "--resume", nargs="?", const="latest", default=None, help="resume (latest or a checkpoint)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--save-state",
        action="store_true",
        help="trainer.save_state() after training, as the transformers example scripts do (the output dir's "
        "trainer_state.json with the final summary)",
    )
    p.add_argument(
        "--bug",
        choices=("data_reset", "reinit_weights", "reinit_lora_b"),
        help="resume with a classic mistake: data restarted from the first batch (ignore_data_skip), the "
        "model's weights re-initialised after the checkpoint loaded (optimizer, scheduler, data restored), or "
        "(with --lora) the adapter's lora_B zeroed again as when a resume silently drops the adapter",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="train an all-linear LoRA adapter (peft.LoraConfig, PEFT's defaults)",
    )
    p.add_argument(
        "--lora-targets",
        default="all-linear",
        help="with --lora: the LoraConfig target_modules, comma-separated, or 'default' for PEFT's own choice",
    )
    a = p.parse_args(argv)
    torch.set_num_threads(1)

    class KillAt(TrainerCallback):
        """Die like a preempted job: no exit, no flush, right after step ``--kill-at`` (and its save)."""

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == a.kill_at and not control.should_save:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_save(self, args, state, control, **kw):
            if state.global_step == a.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    class ReinitWeights(TrainerCallback):
        """The weights a resume silently dropped: fresh values after the Trainer loaded the checkpoint, drawn
        from a generator of their own (the restored RNG streams stay untouched)."""

        def on_train_begin(self, args, state, control, model=None, **kw):
            if state.global_step > 0:
                g = torch.Generator().manual_seed(1234)
                with torch.no_grad():
                    for mod in model.modules():
                        if isinstance(mod, torch.nn.Linear):
                            mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * 0.02)

    class ReinitLoraB(TrainerCallback):
        """The adapter a resume silently dropped: every ``lora_B`` back to PEFT's initial zeros after the Trainer
        loaded the checkpoint (no RNG drawn, so the restored streams stay untouched)."""

        def on_train_begin(self, args, state, control, model=None, **kw):
            if state.global_step > 0:
                with torch.no_grad():
                    for name, t in model.named_parameters():
                        if ".lora_B." in name:
                            t.zero_()

    from transformers import set_seed

    set_seed(a.seed)
    model = tiny_llama()
    if a.lora:
        from peft import LoraConfig, get_peft_model

        targets = None if a.lora_targets == "default" else a.lora_targets
        targets = targets.split(",") if targets and targets != "all-linear" else targets
        model = get_peft_model(model, LoraConfig(target_modules=targets))
    bugs = {"reinit_weights": ReinitWeights, "reinit_lora_b": ReinitLoraB}
    trainer = Trainer(
        model=model,
        args=training_args(a.out, a.steps, a.save_every, a.seed, ignore_data_skip=a.bug == "data_reset"),
        train_dataset=corpus(a.seed),
        callbacks=[CkptCallback(), KillAt(), *([bugs[a.bug]()] if a.bug in bugs else [])],
    )
    resume = True if a.resume == "latest" else a.resume
    trainer.train(resume_from_checkpoint=resume)
    if a.save_state:
        trainer.save_state()
    return 0


if __name__ == "__main__":
    sys.exit(main())
