"""A tiny Llama-style language model trained on synthetic tokens, SIGKILL-safe, with a verifiable run ledger.

Run it, kill it at any moment (``kill -9``, or ``--kill-at STEP``), run the same command again: it resumes
from the newest committed checkpoint and ``ckpt verify-resume RUN`` proves the resume continued exactly::

    python examples/tiny_llama.py --run runs/tiny --steps 40 --kill-at 23
    python examples/tiny_llama.py --run runs/tiny --steps 40
    ckpt verify-resume runs/tiny --plot runs/tiny/resume.png && ckpt report runs/tiny

What it shows, in the order a real loop needs it:

- ``CheckpointManager(on_event=ledger.on_event)``: the manager writes its own save (when committed) and
  restore events (with the seconds they took) into ``RUN/ledger.jsonl``.
- Everything that must survive a restart is saved: model, AdamW moments and per-parameter ``step``, the
  scheduler, every RNG stream (Python, NumPy, torch, XLA) and the sampler's position.  The scheduler is
  built before the restore loads its state.
- Each step logs loss, the LR its update used (read before ``scheduler.step()``), grad norm, samples and
  tokens consumed, a digest of the batch's sample ids and a digest of the RNG state taken before the step.
- ``--device xla`` runs the same loop on the torch-xla device (``PJRT_DEVICE=CPU`` on a machine without an
  accelerator) and logs XLA compilations as ``compile`` events.
- ``--bug NAME`` resumes with one classic mistake, for the verifier to catch and name (see ``BUGS``).
- ``--resume-from CKPT --stop-at S``: restore a given checkpoint and train to step S (in a scratch run
  directory): the shape ``ckpt verify-resume RUN --replay CMD`` needs, e.g.
  ``--replay "python examples/tiny_llama.py --run {run} --resume-from {checkpoint} --stop-at {stop} --steps 40"``.

The model is a hand-written decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) so the
example has no dependency beyond torch; ``--model hf`` uses transformers' ``LlamaForCausalLM`` instead.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import ckpt
from ckpt.resume.ledger import LedgerWriter, checkpoints_dir, digest_ids, digest_rng

BUGS = {
    "none": "correct resume",
    "scheduler_not_restored": "scheduler state not loaded: warmup starts again",
    "rng_not_restored": "RNG streams not restored: dropout/noise differ from the pre-crash run",
    "optimizer_dropped": "optimizer moments and step counters dropped after the restore",
    "data_position_lost": "sampler position not restored: the first batches are seen again",
    "scheduler_last_epoch": "scheduler rebuilt with last_epoch=N instead of loading its state (off by one)",
    "older_checkpoint": "resumed from the second-newest checkpoint instead of the newest",
}

VOCAB, SEQ, N_SEQ, BATCH = 64, 16, 256, 8


# -------------------------------------------------------------------------------------------------- model
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(nn.Module):
    """Pre-norm decoder block: grouped-query causal attention with rotary positions, then a SwiGLU MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd) + mask
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + self.drop(self.o(y))
        h = self.mlp_norm(x)
        return x + self.drop(self.down(F.silu(self.gate(h)) * self.up(h)))


class TinyLlama(nn.Module):
    def __init__(
        self, vocab: int = VOCAB, dim: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
        hidden: int = 64, max_seq: int = SEQ, dropout: float = 0.1,
    ) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, hidden, dropout) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        hd = dim // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(max_seq).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        mask = torch.full((max_seq, max_seq), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos[:t], self.sin[:t], self.mask[:t, :t])
        return self.lm_head(self.norm(x))


def build_model(kind: str) -> nn.Module:
    if kind == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, attention_dropout=0.1,
        )  # fmt: skip
        return LlamaForCausalLM(cfg)
    return TinyLlama()


def logits_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


# --------------------------------------------------------------------------------------------------- data
def synthetic_corpus(seed: int) -> torch.Tensor:
    """N_SEQ sequences from a fixed sparse Markov chain: learnable, so the loss falls, and fully determined."""
    rs = np.random.RandomState(seed)
    nxt = rs.randint(0, VOCAB, size=(VOCAB, 3))
    seqs = np.empty((N_SEQ, SEQ + 1), dtype=np.int64)
    seqs[:, 0] = rs.randint(0, VOCAB, size=N_SEQ)
    for j in range(1, SEQ + 1):
        seqs[:, j] = nxt[seqs[:, j - 1], rs.randint(0, 3, size=N_SEQ)]
    return torch.from_numpy(seqs)


class ResumableSampler:
    """Shuffled batches of sample ids with a saved position: (epoch, index) plus totals consumed.

    The permutation of each epoch comes from its own seeded generator, so restoring (epoch, index) is enough
    to continue with exactly the next batch; counted on batches *consumed*, not prefetched.
    """

    def __init__(self, n: int, batch: int, seed: int) -> None:
        self.n, self.batch, self.seed = n, batch, seed
        self.epoch = self.index = self.samples = 0

    def next(self) -> torch.Tensor:
        if self.index >= self.n // self.batch:
            self.epoch, self.index = self.epoch + 1, 0
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        ids = perm[self.index * self.batch : (self.index + 1) * self.batch]
        self.index += 1
        self.samples += len(ids)
        return ids

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index, self.samples = int(state["epoch"]), int(state["index"]), int(state["samples"])


def lr_lambda(total: int, warmup: int = 5):
    def f(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (i - warmup) / max(1, total - warmup)))

    return f


# ----------------------------------------------------------------------------------------------- training
def _xla_compiles() -> tuple[int, float]:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return (0, 0.0) if not data else (int(data[0]), float(data[1]) / 1e9)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory: ledger.jsonl and checkpoints/")
    p.add_argument("--steps", type=int, default=40, help="total steps (the LR schedule's length)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (default: --steps)")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=0, help="SIGKILL this process right after this step")
    p.add_argument(
        "--kill-settled",
        action="store_true",
        help="with --kill-at: let earlier async saves commit before the kill, for a reproducible crash point",
    )
    p.add_argument(
        "--kill-committed",
        action="store_true",
        help="with --kill-at: let every save, this step's too, commit first: a crash right after a checkpoint, "
        "so no step after the restore point is logged before the crash (the no-overlap case)",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (kill tests)")
    p.add_argument("--device", choices=("cpu", "xla"), default="cpu")
    p.add_argument("--model", choices=("tiny", "hf"), default="tiny")
    p.add_argument("--bug", choices=sorted(BUGS), default="none", help="resume with this mistake")
    p.add_argument("--resume-from", default=None, help="restore this checkpoint instead of the latest")
    p.add_argument("--no-save", action="store_true", help="do not write checkpoints (replay)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    stop_at = a.stop_at or a.steps

    # Determinism: one thread and deterministic kernels, so a correct resume is bit-exact on CPU.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    if a.device == "xla":
        import torch_xla
        import torch_xla.core.xla_model as xm

        device = torch_xla.device()
        xm.set_rng_state(a.seed)
    else:
        device = torch.device("cpu")

    corpus = synthetic_corpus(a.seed)
    model = build_model(a.model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(a.steps))  # before the restore, always
    sampler = ResumableSampler(N_SEQ, BATCH, a.seed)

    run = Path(a.run)
    ledger = LedgerWriter(
        run,
        world_size=1,
        deterministic=True,
        seed=a.seed,
        tokenizer_id=f"synthetic-markov-v{VOCAB}",
        extra_env={"device": a.device, "model": a.model, "bug": a.bug},
    )
    mgr = ckpt.CheckpointManager(str(checkpoints_dir(run)), async_save=True, on_event=ledger.on_event)

    state: dict[str, object] = {"model": model, "optimizer": opt, "scheduler": sched, "dataloader": sampler}
    if a.bug == "scheduler_not_restored" or a.bug == "scheduler_last_epoch":
        del state["scheduler"]
    if a.bug == "data_position_lost":
        del state["dataloader"]
    rng = a.bug != "rng_not_restored"
    restored: int | None = None
    if a.resume_from:
        t0 = time.perf_counter()
        result = ckpt.restore(a.resume_from, rng=rng, **state)
        restored = result.step
        ledger.restore(restored, a.resume_from, seconds=time.perf_counter() - t0)
    elif a.bug == "older_checkpoint":
        committed = [i.step for i in mgr.list() if i.status == "committed"]
        if len(committed) >= 2:
            restored = mgr.restore(committed[-2], rng=rng, **state).step
        elif committed:
            restored = mgr.restore(committed[-1], rng=rng, **state).step
    else:
        restored = mgr.restore_latest(rng=rng, **state)
    if restored is not None:
        if a.bug == "optimizer_dropped":
            opt.state.clear()  # moments and per-parameter step lost; param_groups (the LR) kept
        if a.bug == "scheduler_last_epoch":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(a.steps), last_epoch=restored)
    start = (restored or 0) + 1

    compiles = _xla_compiles() if a.device == "xla" else (0, 0.0)
    for step in range(start, stop_at + 1):
        rng_digest = digest_rng()  # before anything this step draws
        ids = sampler.next()
        seq = corpus[ids]
        inputs, targets = seq[:, :-1].clone(), seq[:, 1:]
        noise = np.random.rand(*inputs.shape) < 0.05  # token corruption: the NumPy stream matters too
        inputs[torch.from_numpy(noise)] = torch.from_numpy(np.random.randint(0, VOCAB, int(noise.sum())))
        inputs, targets = inputs.to(device), targets.to(device)
        model.train()
        loss = F.cross_entropy(logits_of(model, inputs).reshape(-1, VOCAB), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        if a.device == "xla":
            torch_xla.sync()
        ledger.step(
            step,
            loss,
            lr,
            grad_norm=grad_norm,
            samples=sampler.samples,
            tokens=sampler.samples * SEQ,
            data_digest=digest_ids(ids),
            rng_digest=rng_digest,
        )
        if a.device == "xla":
            now = _xla_compiles()
            if now[0] > compiles[0]:
                ledger.compile(now[1] - compiles[1], what=f"xla: {now[0] - compiles[0]} graph(s)")
            compiles = now
        if not a.no_save and step % a.save_every == 0:
            progress = {"samples": sampler.samples, "tokens": sampler.samples * SEQ}
            state = {"model": model, "optimizer": opt, "scheduler": sched, "dataloader": sampler}
            # Resuming from an older checkpoint re-trains steps whose checkpoints exist: replace them.
            mgr.save(step, progress=progress, overwrite=a.bug == "older_checkpoint", **state)
        if step == a.kill_at:
            if a.kill_committed or (a.kill_settled and step % a.save_every != 0):
                mgr.wait()
            time.sleep(0.002)  # let the async writer start, then die mid-save
            os.kill(os.getpid(), signal.SIGKILL)
        if a.step_sleep:
            time.sleep(a.step_sleep)
    mgr.close()  # waits for the last async save, whose commit event goes to the ledger
    ledger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
