"""Two more steps of the NxD fixture's run (``fixtures/nxd/llama_gqa_h64``: 3 AdamW steps, saved by NxD's
``save_checkpoint``), taken two ways in this process, on one fixed batch; prints the two losses as JSON.

``truth``: the run continued as it was trained: its weights, its full AdamW state (``optimizer_full.safetensors``,
``torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)``), its cosine scheduler
(``scheduler.json``, warmup 2 of 100), no clipping.
``trainer DIR``: a real ``transformers.Trainer`` (cosine, warmup 2, 100 steps, the same AdamW settings, no
clipping) resumed with ``train(resume_from_checkpoint=DIR)``, stopped after step 5.
Run with ``USE_TORCH_XLA=0`` (CPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("USE_TORCH_XLA", "0")

import torch  # noqa: E402

TRUTH = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"
STOP = 5


def batch() -> torch.Tensor:
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(99))


def truth() -> list[float]:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    model = AutoModelForCausalLM.from_pretrained(TRUTH, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=100)
    sched.load_state_dict(json.loads((TRUTH / "scheduler.json").read_text()))
    for g in opt.param_groups:
        g["lr"] = sched.get_last_lr()[0]
    full = load_file(TRUTH / "optimizer_full.safetensors")
    for name, p in model.named_parameters():
        opt.state[p] = {k: full[f"{name}.{k}"].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
    x, losses = batch(), []
    for _ in range(STOP - 3):
        loss = model(input_ids=x, labels=x).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


def trainer(ckpt: str, out: str) -> list[float]:
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    losses: list[float] = []

    class Record(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float(loss.detach()))
            return loss

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            control.should_training_stop = state.global_step >= STOP

    x = batch()
    rows = [{"input_ids": r, "labels": r} for r in x]  # one batch of 4: every step sees the same rows
    args = TrainingArguments(
        output_dir=out, max_steps=100, per_device_train_batch_size=4, learning_rate=1e-3, weight_decay=0.01,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, lr_scheduler_type="cosine", warmup_steps=2,
        max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TRUTH))
    Record(model=model, args=args, train_dataset=rows, callbacks=[Stop()]).train(resume_from_checkpoint=ckpt)
    return losses


if __name__ == "__main__":
    torch.set_num_threads(1)
    got = truth() if sys.argv[1] == "truth" else trainer(sys.argv[2], sys.argv[3])
    print(json.dumps(got))
