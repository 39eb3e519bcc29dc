"""A training process built to be killed: tiny MLP, Adam, async CheckpointManager saves, an event log.

    python tests/torture/trainer.py --root ROOT --log LOG [--endpoint URL] [--every 1] [--keep-last 2]
        [--local-dir DIR --persist-every N]

On start it calls ``restore_latest`` and logs ``{"ev": "ready", "restored": step|null, "digest": ...}``; then it
trains forever (until SIGKILL or ``--max-steps``), logging per step ``{"ev": "step", "step": N, "loss": hex}``,
before each save ``{"ev": "save", "step": N, "digest": ...}`` (a SHA-256 of the exact model + optimizer state being
saved), after it ``{"ev": "staged", "step": N, "lazy_bytes": B}`` (bytes left to the background copy: lazy
staging lets training mutate the tensors while they are still being copied) and, from the manager's commit callback, ``{"ev": "committed", "step": N}``.

Why it looks like this: the harness must compare what a restart restores against what was *committed*, without
trusting the code under test, so the process records a digest of the state it hands to ``save`` (async saves stage
it before returning; training then keeps mutating the live tensors). Batches depend only on the step number, so a
resumed run must reproduce the killed run's losses bit for bit: the harness checks that too. Each log line is one
``os.write`` to an ``O_APPEND`` file, so a SIGKILL can cut the log only between events.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

import torch

import ckpt

DIM = 384


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh(), torch.nn.Linear(DIM, DIM))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: a function of the step only, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, DIM, generator=g)
    return x, x.flip(1).tanh()


def state_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 over every model tensor and every optimizer state value, in a fixed order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for idx, st in sorted(opt.state_dict()["state"].items()):
        for key, v in sorted(st.items()):
            h.update(f"{idx}/{key}".encode())
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


class EventLog:
    """Append-only JSON-lines log; one ``os.write`` per event so that a kill never leaves half a line."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.pid = os.getpid()

    def __call__(self, ev: str, **fields: Any) -> None:
        line = json.dumps({"ev": ev, "pid": self.pid, "t": time.time(), **fields}) + "\n"
        os.write(self.fd, line.encode())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--endpoint", help="S3 endpoint URL (moto) for s3:// roots")
    p.add_argument("--every", type=int, default=1, help="save every N steps")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=10**9)
    p.add_argument("--eager", dest="lazy", action="store_false", help="copy all state before save() returns")
    p.add_argument(
        "--process-writer",
        action="store_true",
        help="write data files from the writer process (the default); without it, from a thread of the trainer",
    )
    p.add_argument("--local-dir", help="the node-local tier (ckpt.tiers): every save goes there")
    p.add_argument("--persist-every", type=int, help="with --local-dir: steps also copied to ROOT")
    p.add_argument("--local-memory", action="store_true", help="with --local-dir: the host-memory tier")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    log = EventLog(args.log)
    options = {"client_kwargs": {"endpoint_url": args.endpoint}} if args.endpoint else None
    model, opt = make_model()

    def on_event(kind: str, info: dict[str, Any]) -> None:
        if kind == "save":
            log("committed", step=info["step"])

    tiers: dict[str, Any] = {}
    if args.local_dir:
        tiers = {
            "local_dir": args.local_dir,
            "persist_every": args.persist_every,
            "keep_local": args.keep_last,
            "local_memory": args.local_memory,
        }
    mgr = ckpt.CheckpointManager(
        args.root,
        keep_last=args.keep_last,
        async_save=True,
        storage_options=options,
        on_event=on_event,
        **tiers,
    )
    # the writer process is the default; without the flag the torture runs keep the in-process writer thread covered
    from ckpt.saving.process_writer import ProcessStager
    from ckpt.saving.staging import HostStager

    if not args.local_memory:  # the memory tier's stager is its own (ckpt.tiers.memory)
        mgr.checkpointer.stager = ProcessStager() if args.process_writer else HostStager()
    restored = mgr.restore_latest(model=model, optimizer=opt)
    log("ready", restored=restored, digest=state_digest(model, opt) if restored is not None else None)
    step = restored or 0
    while step < args.max_steps:
        step += 1
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log("step", step=step, loss=float(loss.detach()).hex())
        if step % args.every == 0:
            log("save", step=step, digest=state_digest(model, opt))
            mgr.save(step, model=model, optimizer=opt, lazy=args.lazy)
            staging = mgr.checkpointer.last_staging
            writer = getattr(mgr.checkpointer.stager, "writer_pid", None)
            log("staged", step=step, lazy_bytes=staging.lazy_bytes if staging else 0, writer=writer)
    mgr.close()
    log("exit", step=step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
