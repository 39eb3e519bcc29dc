"""Crash-consistency torture for ``ckpt convert``: SIGKILL real conversions at random moments, inspect DST and SRC.

    .venv/bin/python bench/torture_convert.py --trials 20      # 20 kills for each of ckpt, ckpt --workers 2, hf, dcp, nxd

Each trial runs ``python -m ckpt convert`` on local disk in its own process group and kills the group with SIGKILL
after a seeded random delay (see ``tests/torture/convert_crash.py``); DST must then hold nothing that looks valid
(no manifest.json, no HF/DCP folder, no NxD ``done``), or exactly the reference output when the kill landed after
the commit; SRC must be byte-identical. Prints the figures and writes ``bench/results/torture_convert.json``.
Exit status 1 when any corrupt output or changed SRC was found.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from torture.convert_crash import CASES, make_source, run_trials  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20, help="kills per case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", nargs="*", choices=list(CASES), default=list(CASES))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckpt-torture-convert-") as work:
        src = make_source(Path(work) / "src")
        report = run_trials(src, Path(work), args.trials, seed=args.seed, cases=args.cases, progress=True)
    summary = report.summary()
    summary["args"] = vars(args)
    print(json.dumps(summary, indent=2))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "torture_convert.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return 1 if report.corrupt or report.src_changed else 0


if __name__ == "__main__":
    sys.exit(main())
