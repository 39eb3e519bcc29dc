"""A tiny data-parallel training job used by ``ckpt demo`` (and runnable by hand with torchrun).

It trains a tiny Llama (Hugging Face ``LlamaForCausalLM``: GQA, attention dropout) with AdamW and a warmup
schedule on synthetic token sequences, checkpoints asynchronously
with :class:`ckpt.CheckpointManager` every ``--save-every`` steps, and can kill itself with SIGKILL at
``--kill-at`` to play a crash.  Every step's loss is appended to ``<run>/losses.jsonl`` in full precision, and
rank 0 writes the run ledger ``<run>/ledger.jsonl`` (docs/run-dir.md) that ``ckpt verify-resume`` and
``ckpt report`` read: the manager logs its own save/restore events into it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

import ckpt
from ckpt.resume.ledger import LedgerWriter, digest_ids, digest_rng

VOCAB, SEQ = 64, 16


def tiny_llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attention_dropout=0.1,
        tie_word_embeddings=False,
    )


class ShardedBatches:
    """Deterministic synthetic token sequences (learnable: t+1 = 3t+1 mod V), sharded by rank, resumable."""

    def __init__(self, rank: int, world: int, batch: int = 8, size: int = 512) -> None:
        self.rank, self.world, self.batch, self.size = rank, world, batch, size
        self.epoch, self.pos = 0, 0

    def next_with_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's sample ids (for the ledger's data digest) and its token ids."""
        per_epoch = self.size // (self.batch * self.world)
        if self.pos >= per_epoch:
            self.epoch, self.pos = self.epoch + 1, 0
        g = torch.Generator().manual_seed(1000 + self.epoch)
        perm = torch.randperm(self.size, generator=g)
        start = (self.pos * self.world + self.rank) * self.batch
        idx = perm[start : start + self.batch]
        tokens = [idx % VOCAB]
        for _ in range(SEQ - 1):
            tokens.append((tokens[-1] * 3 + 1) % VOCAB)
        self.pos += 1
        return idx, torch.stack(tokens, dim=1)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


def build(rank: int, world: int, total_steps: int) -> tuple:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 5
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / total_steps)
    )
    return model, opt, sched, ShardedBatches(rank, world)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--keep-last", type=int, default=3)
    a = p.parse_args(argv)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.set_num_threads(1)
    model, opt, sched, data = build(rank, world, a.steps)
    torch.manual_seed(1234 + rank)
    if rank == 0:
        model.config.to_json_file(f"{a.run}/config.json")
    ledger = LedgerWriter(a.run, world_size=world, deterministic=True, seed=1234, enabled=rank == 0)
    mgr = ckpt.CheckpointManager(
        f"{a.run}/checkpoints", keep_last=a.keep_last, async_save=True, on_event=ledger.on_event
    )
    state = {"model": model, "optimizer": opt, "scheduler": sched, "dataloader": data}
    t0 = time.perf_counter()
    restored = mgr.restore_latest(**state)
    start = (restored or 0) + 1
    log = open(f"{a.run}/losses.jsonl", "a") if rank == 0 else None  # noqa: SIM115
    if log is not None:
        log.write(
            json.dumps({"event": "start", "restored": restored, "restore_s": time.perf_counter() - t0}) + "\n"
        )
        log.flush()
    saves: dict[int, Future] = {}
    for step in range(start, a.steps + 1):
        rng_digest = digest_rng()
        ids, tokens = data.next_with_ids()
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
            dist.all_reduce(loss)
            loss /= world
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        ledger.step(
            step,
            loss,
            lr,
            samples=step * data.batch * world,
            data_digest=digest_ids(ids),
            rng_digest=rng_digest,
        )
        if log is not None:
            log.write(
                json.dumps({"step": step, "loss": loss.item().hex(), "lr": sched.get_last_lr()[0]}) + "\n"
            )
            log.flush()
        if step % a.save_every == 0:
            saves[step] = mgr.save(step, progress={"samples": step * 8 * world}, **state)
        if step == a.kill_at:
            # The crash the demo shows is "newest save in flight, an older one committed": on a loaded machine an
            # async save can take longer than the steps between it and the kill, so the older ones are awaited.
            for s in sorted(saves):
                if s < step:
                    saves[s].result()
            time.sleep(0.002)  # let the background writer get going, then crash mid-save
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()  # waits for the last async save, whose commit event goes to the ledger
    ledger.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
