"""Crash-consistency torture: SIGKILL a checkpointing training process at random moments, restart, verify.

    .venv/bin/python bench/torture_crash.py --trials 100 --storage local
    .venv/bin/python bench/torture_crash.py --trials 20 --storage s3      # moto server on 127.0.0.1
    .venv/bin/python bench/torture_crash.py --trials 30 --local-tier --persist-every 3   # ckpt.tiers
    .venv/bin/python bench/torture_crash.py --trials 30 --local-memory --persist-every 3  # the host-memory tier

Each trial starts ``tests/torture/trainer.py`` (tiny MLP + Adam, async ``CheckpointManager`` save every step,
``keep_last=2``), kills it with SIGKILL after a seeded random delay, fully verifies every committed checkpoint and
checks that the next start restores the newest one with exactly the state that was saved, then keeps training with
bit-identical losses. Prints the figures and writes ``bench/results/torture_crash_<storage>.json``.
Exit status 1 when any corrupt restore or divergent loss was found.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from torture.crash import run_trials  # noqa: E402
from torture.s3 import moto_server  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--storage", choices=("local", "s3"), default="local")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-delay", type=float, default=1.5, help="upper bound of the random kill delay (s)")
    p.add_argument("--every", type=int, default=1, help="save every N steps")
    p.add_argument(
        "--local-tier", action="store_true", help="save every step to a node-local tier (ckpt.tiers)"
    )
    p.add_argument("--persist-every", type=int, help="with --local-tier: also to the root every N steps")
    p.add_argument(
        "--local-memory",
        action="store_true",
        help="the local tier in /dev/shm as the host-memory tier (local_memory=True)",
    )
    p.add_argument(
        "--process-writer",
        action="store_true",
        help="the trainer writes through ProcessStager's writer process (the default); without it, HostStager's thread",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckpt-torture-") as work:
        common = dict(seed=args.seed, max_delay=args.max_delay, every=args.every, progress=True)
        if args.local_memory:
            shm = tempfile.mkdtemp(prefix="ckpt-torture-", dir="/dev/shm")
            common.update(local_dir=shm, persist_every=args.persist_every, local_memory=True)
        elif args.local_tier:
            common.update(local_dir=os.path.join(work, "local"), persist_every=args.persist_every)
        if args.process_writer:
            common.update(process_writer=True)
        if args.storage == "local":
            report = run_trials(os.path.join(work, "run"), work, args.trials, **common)
        else:
            with moto_server("ckpt-torture") as endpoint:
                report = run_trials("s3://ckpt-torture/run", work, args.trials, endpoint=endpoint, **common)
    summary = report.summary()
    summary["args"] = vars(args)
    print(json.dumps(summary, indent=2))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    if args.local_memory:
        import shutil

        shutil.rmtree(common["local_dir"], ignore_errors=True)
    tail = ("_memory" if args.local_memory else "_tiers" if args.local_tier else "") + (
        "_process_writer" if args.process_writer else ""
    )
    with open(os.path.join(HERE, "results", f"torture_crash_{args.storage}{tail}.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return 1 if report.corrupt_restores or report.divergent_losses else 0


if __name__ == "__main__":
    sys.exit(main())
