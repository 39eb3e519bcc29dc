"""Time ``verify-resume`` on a generated 100,000-step ledger (two crashes, overlap, digests on every step).

Run: ``.venv/bin/python bench/bench_verify_resume.py [steps]``; prints write/read/verify/cost seconds, and
the wall time of the whole ``ckpt verify-resume RUN --json`` command in a fresh process (interpreter start,
imports and output included), which is what a user waits for.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ckpt.resume.cost import recovery_cost
from ckpt.resume.ledger import LedgerWriter, digest_ids
from ckpt.resume.sources import load_run
from ckpt.resume.verify import verify_run


def lr(step: int, total: int) -> float:
    return 3e-4 * min(1.0, step / 2000) * 0.5 * (1 + math.cos(math.pi * step / total))


def generate(run_dir: Path, total: int) -> None:
    crashes = [(c, c // 500 * 500) for c in (int(total * 0.4) + 350, int(total * 0.75) + 120)]
    start = 0
    rng = random.Random(0)
    for crash, resume in [*crashes, (total, None)]:
        with LedgerWriter(run_dir, deterministic=False, world_size=64, buffer_lines=256) as w:
            if start:
                w.restore(start, f"checkpoints/step-{start}", 20.0)
            for s in range(start + 1, crash + 1):
                w.step(
                    s,
                    2 + 8 / math.sqrt(s) + rng.gauss(0, 0.02),
                    lr(s, total),
                    grad_norm=1.0,
                    samples=s * 512,
                    data_digest=digest_ids([s]),
                    rng_digest=f"{s:016x}",
                )
                if s % 500 == 0:
                    w.save(s, f"checkpoints/step-{s}", 0.4, 3.0)
        start = resume or 0


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        generate(Path(tmp), total)
        t1 = time.perf_counter()
        run = load_run(tmp)
        t2 = time.perf_counter()
        result = verify_run(run)
        t3 = time.perf_counter()
        recovery_cost(run)
        t4 = time.perf_counter()
        cli = [sys.executable, "-m", "ckpt", "verify-resume", tmp, "--json"]
        code = subprocess.run(cli, stdout=subprocess.DEVNULL, check=False).returncode
        t5 = time.perf_counter()
    print(f"{run.num_steps} step records, {len(result.verdicts)} boundaries, exit code {result.exit_code}")
    print(
        f"write {t1 - t0:.2f}s  read {t2 - t1:.2f}s  verify {t3 - t2:.2f}s  cost {t4 - t3:.2f}s  "
        f"read+verify {t3 - t1:.2f}s"
    )
    print(f"ckpt verify-resume (fresh process, end to end) {t5 - t4:.2f}s, exit code {code}")


if __name__ == "__main__":
    main()
