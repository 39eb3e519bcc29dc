"""Detection and false-positive rates of ``verify-resume`` per defect class, from real crashed-and-restarted runs.

Run: ``.venv/bin/python bench/verify_resume_truth.py [--seeds 20] [--out bench/results/verify_resume_truth.json]``

For every model size (``small``, ``large``), seed and crash mode (7 overlapping steps, or a crash right after
the checkpoint) it trains one trunk and resumes it once per defect class (``ckpt.resume.truth``), then asks the
verifier about each resumed run as TensorBoard (default mode and ``--deterministic``) and as the ledger, each
logged every step and every 5th step.  Prints the markdown tables that docs/verify-resume.md carries and writes
every row (verdict, causes, measured effect) as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from ckpt.resume.truth import CLEAN, DEFECTS, SIZES, VIEWS, TruthConfig, measure

LOSS_THRESHOLD = 0.05
"""Documented threshold: a defect that moves the mean loss of the first 10 resumed steps by more than this
(relative, against the clean continuation) or the LR by more than ``LR_THRESHOLD`` must be detected."""
LR_THRESHOLD = 0.01


def run_grid(seeds: int, defects: tuple[str, ...]) -> list[dict]:
    rows: list[dict] = []
    t0 = time.time()
    jobs = [(size, seed, ov) for size in SIZES for ov in (True, False) for seed in range(seeds)]
    for i, (size, seed, ov) in enumerate(jobs, 1):
        with tempfile.TemporaryDirectory() as tmp:
            rows += measure(TruthConfig(size=size, seed=seed, overlap=ov), Path(tmp), defects)
        done = time.time() - t0
        print(
            f"\r{i}/{len(jobs)} trunks, {done:.0f} s, ~{done / i * (len(jobs) - i):.0f} s left",
            end="",
            file=sys.stderr,
        )
    print(file=sys.stderr)
    return rows


def _view_name(fmt: str, every: int, det: bool | None) -> str:
    mode = "" if det is None else (" --deterministic" if det else "")
    return f"{'TB' if fmt == 'tensorboard' else 'ledger'}{mode}, every {every}"


def _forced(r: dict) -> bool:
    """``--deterministic`` forced on the nondeterministic clean class: failing is the right answer there."""
    return r["defect"] == "clean_nondeterministic" and r["deterministic"] is True


def _rate(rows: list[dict], clean: bool) -> str:
    if not rows:
        return "-"
    if all(_forced(r) for r in rows):
        return f"fails {100 * sum(r['exit'] == 1 for r in rows) / len(rows):.0f}% (forced bitwise)"
    hit = sum(r["exit"] == (0 if clean else 1) for r in rows)
    return f"{100 * hit / len(rows):.0f}%"


def _big(r: dict) -> bool:
    return (math.isfinite(r["loss_effect"]) and abs(r["loss_effect"]) > LOSS_THRESHOLD) or (
        math.isfinite(r["lr_effect"]) and r["lr_effect"] > LR_THRESHOLD
    )


def tables(rows: list[dict]) -> str:
    """Markdown: per crash mode, rows = defect classes, columns = views; a cell is the detection rate (the
    share of runs exiting 1) for a defect, the share exiting 0 for a clean class; ``big`` restricts to runs
    whose effect exceeds the documented threshold."""
    out = []
    views = [(f, e, d) for f, e, d in VIEWS]
    for ov in (True, False):
        title = "7 overlapping steps" if ov else "no overlap (crash right after the checkpoint)"
        out.append(
            f"\n**{title}** (detected / clean-and-passed, over {{n}} runs per cell; in brackets: runs whose "
            f"effect exceeds the threshold)\n"
        )
        out.append("| class | " + " | ".join(_view_name(*v) for v in views) + " | median loss effect |")
        out.append("|---|" + "---|" * (len(views) + 1))
        n = 0
        for d in DEFECTS:
            cells = []
            for v in views:
                sel = [
                    r
                    for r in rows
                    if r["defect"] == d
                    and r["overlap"] == ov
                    and (r["format"], r["every"], r["deterministic"]) == v
                ]
                n = max(n, len(sel))
                cell = _rate(sel, d in CLEAN)
                big = [r for r in sel if _big(r)]
                if d not in CLEAN and big and len(big) != len(sel):
                    cell += f" ({_rate(big, False)} of {len(big)})"
                cells.append(cell)
            effects = sorted(
                r["loss_effect"]
                for r in rows
                if r["defect"] == d and r["overlap"] == ov and math.isfinite(r["loss_effect"])
            )
            med = effects[len(effects) // 2] if effects else math.nan
            out.append(f"| {d} | " + " | ".join(cells) + f" | {100 * med:+.1f}% |")
        out[-len(DEFECTS) - 3] = out[-len(DEFECTS) - 3].replace("{n}", str(n))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--defects", default=",".join(DEFECTS))
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "verify_resume_truth.json"
    )
    ap.add_argument("--from-json", type=Path, help="Print the tables of an earlier run's rows.")
    args = ap.parse_args()
    if args.from_json:
        rows = json.loads(args.from_json.read_text())
    else:
        rows = run_grid(args.seeds, tuple(args.defects.split(",")))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=0))
    print(tables(rows))
    fp = [r for r in rows if r["defect"] in CLEAN and not _forced(r) and r["exit"] != 0]
    missed = [r for r in rows if r["defect"] not in CLEAN and _big(r) and r["exit"] != 1]
    print(
        f"\nfalse positives: {len(fp)} / {sum(r['defect'] in CLEAN and not _forced(r) for r in rows)} clean verdicts"
    )
    print(f"missed above threshold (loss > {LOSS_THRESHOLD:.0%} or LR > {LR_THRESHOLD:.0%}): {len(missed)}")
    for r in missed[:20]:
        print(
            "  missed:",
            {
                k: r[k]
                for k in (
                    "defect",
                    "size",
                    "seed",
                    "overlap",
                    "format",
                    "every",
                    "deterministic",
                    "loss_effect",
                    "lr_effect",
                )
            },
        )


if __name__ == "__main__":
    main()
