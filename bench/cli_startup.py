"""How long the ``ckpt`` command takes to answer, and how much memory it needs, for commands that touch no tensor.

    .venv/bin/python bench/cli_startup.py [--runs 10]

Times ``ckpt --help``, ``--version``, ``ls``, ``inspect``, ``report`` and ``verify-resume`` on a small checkpoint
root and a simulated run (made first, in a temporary folder), each as a fresh process (``python -m ckpt``), and
reports the median wall time and the peak RSS (``wait4``).  It also says whether the process imported torch,
which is what decides the figures (docs/performance.md, "CLI startup").
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _make_inputs(tmp: Path) -> None:
    """Run in a child process (``--make-inputs``): the timing process must stay small, because a forked child's
    peak RSS counts the parent's pages until it execs."""
    import torch

    import ckpt

    sys.path.insert(0, str(HERE.parent / "tests"))
    from test_resume_sim import simulate

    root = tmp / "checkpoints"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    for step in (10, 20, 30):
        ckpt.save(str(root / f"step_{step:08d}"), step=step, model=model)
    simulate(tmp / "run")


def _time(argv: list[str], runs: int) -> tuple[float, float, bool]:
    """Median seconds, peak RSS in MiB, and whether torch was imported (one extra run with -X importtime)."""
    walls, rss = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(p.pid, 0)
        walls.append(time.perf_counter() - t0)
        rss.append(usage.ru_maxrss / 1024)
        p.returncode = os.waitstatus_to_exitcode(status)
    trace = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], capture_output=True, text=True)
    torch = any(line.split("|")[-1].strip() == "torch" for line in trace.stderr.splitlines())
    return statistics.median(walls), max(rss), torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--make-inputs", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_inputs:
        _make_inputs(args.make_inputs)
        return 0
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, __file__, "--make-inputs", d], check=True)
        root = Path(d) / "checkpoints"
        paths = {"root": root, "ckpt": root / "step_00000030", "run": Path(d) / "run"}
        cases = {
            "ckpt --help": ["--help"],
            "ckpt --version": ["--version"],
            "ckpt ls ROOT": ["ls", str(paths["root"])],
            "ckpt inspect CKPT": ["inspect", str(paths["ckpt"])],
            "ckpt report RUN": ["report", str(paths["run"])],
            "ckpt verify-resume RUN": ["verify-resume", str(paths["run"])],
        }
        cases["ckpt ls RUN (one level up)"] = ["ls", str(Path(d))]
        cases["ckpt inspect CKPT/manifest.json"] = ["inspect", str(paths["ckpt"] / "manifest.json")]
        print(f"{'command':<32} {'median':>8} {'peak RSS':>10}  torch imported")
        # the same-load reference: what every command paid when ckpt imported torch at startup
        wall, rss, _ = _time([sys.executable, "-c", "import torch"], args.runs)
        label = 'python -c "import torch"'
        print(f"{label:<32} {wall:>7.2f}s {rss:>7.0f} MiB  (reference)", flush=True)
        for name, cli_args in cases.items():
            wall, rss, torch = _time([sys.executable, "-m", "ckpt", *cli_args], args.runs)
            print(f"{name:<32} {wall:>7.2f}s {rss:>7.0f} MiB  {'yes' if torch else 'no'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
