"""Detection and false-positive rates of ``verify-resume`` per defect class, from real crashed-and-restarted runs.

Run: ``.venv/bin/python bench/verify_resume_truth.py [--seeds 20] [--out bench/results/verify_resume_truth.json]``
and ``--source trainer --seeds 24`` for the second source (``ckpt.resume.truth_trainer``: real
``transformers.Trainer`` runs the thresholds never saw; ``--minutes`` stops starting trunks after that long).
``--from-json A.json --trainer-json B.json`` prints both sources' tables from earlier runs.

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


def run_grid(
    seeds: int,
    defects: tuple[str, ...],
    formats: tuple[str, ...] = ("tensorboard", "ledger"),
    overlaps: tuple[bool, ...] = (True, False),
) -> list[dict]:
    rows: list[dict] = []
    t0 = time.time()
    views = tuple(v for v in VIEWS if v[0] in formats)
    jobs = [(size, seed, ov) for size in SIZES for ov in overlaps for seed in range(seeds)]
    for i, (size, seed, ov) in enumerate(jobs, 1):
        with tempfile.TemporaryDirectory() as tmp:
            rows += measure(TruthConfig(size=size, seed=seed, overlap=ov), Path(tmp), defects, views)
        done = time.time() - t0
        print(
            f"\r{i}/{len(jobs)} trunks, {done:.0f} s, ~{done / i * (len(jobs) - i):.0f} s left",
            end="",
            file=sys.stderr,
        )
    print(file=sys.stderr)
    return rows


STEPPED = ("lr_halved", "scheduler_lost", "lr_off_by_one")
"""Defects of a scheduler stepped per update (base LRs, ``last_epoch``): not planted in ``ReduceLROnPlateau``
runs, whose scheduler has neither."""


def run_trainer(
    seeds: int,
    minutes: float,
    out: Path,
    extra: int = 0,
    first: int = 0,
    only: tuple[str, ...] | None = None,
    formats: tuple[str, ...] = ("tensorboard", "ledger"),
    overlaps: tuple[bool, ...] = (True, False),
) -> list[dict]:
    """The Trainer grid: per seed one config (scheduler, accumulation, bf16, logging by seed), with and
    without overlap; then ``extra`` seeds of the two extra trunks (a torch ``StepLR`` whose first milestone is
    N+1, a logged curriculum phase change at N+1) with their branches; rows are written after every trunk so a
    stopped run keeps what it measured.  ``only``, ``formats`` and ``overlaps`` restrict the classes, views and
    crash modes (a partial rerun)."""
    from ckpt.resume.truth_trainer import DEFECTS as T_DEFECTS
    from ckpt.resume.truth_trainer import EXTRA_DEFECTS, TrainerTruthConfig
    from ckpt.resume.truth_trainer import VIEWS as T_VIEWS
    from ckpt.resume.truth_trainer import measure as measure_trainer

    def keep(defects: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(d for d in defects if only is None or d in only)

    rows: list[dict] = []
    t0 = time.time()
    views = tuple(v for v in T_VIEWS if v[0] in formats)
    jobs = [
        (cfg, keep(tuple(d for d in T_DEFECTS if not (cfg.scheduler == "reduce_lr_on_plateau" and d in STEPPED))))
        for s in range(first, seeds)
        for cfg in (TrainerTruthConfig.from_seed(s, overlap=ov) for ov in overlaps)
    ]
    for s in range(first if first < extra else extra, extra):
        for kw in ({"scheduler": "step_lr"}, {"curriculum": True, "scheduler": "cosine"}):
            jobs += [(TrainerTruthConfig.from_seed(s, overlap=ov, **kw), keep(EXTRA_DEFECTS)) for ov in overlaps]
    jobs = [(cfg, defects) for cfg, defects in jobs if defects]
    for i, (cfg, defects) in enumerate(jobs, 1):
        if time.time() - t0 > 60 * minutes:
            print(f"\nstopped after {i - 1} trunks ({minutes:g} min)", file=sys.stderr)
            break
        with tempfile.TemporaryDirectory() as tmp:
            rows += measure_trainer(cfg, Path(tmp), defects, views)
        out.write_text(json.dumps(rows, indent=0))
        print(f"\r{i}/{len(jobs)} trunks, {time.time() - t0:.0f} s", end="", file=sys.stderr)
    print(file=sys.stderr)
    return rows


def _trainer_class(r: dict) -> str:
    if r["defect"] == "clean" and r.get("event"):
        return f"clean, {r['event']} at N+1"
    return r["defect"]


def trainer_tables(rows: list[dict]) -> str:
    """Markdown for the Trainer source: rows = classes (clean split by the schedule event at N+1), columns =
    views x logging interval; a cell is the share exiting 1 (defect) or 0 (clean), then the share that exited 0
    saying "cannot tell" (a defect), and the count."""
    from ckpt.resume.truth_trainer import CLEAN as T_CLEAN
    from ckpt.resume.truth_trainer import DEFECTS as T_DEFECTS
    from ckpt.resume.truth_trainer import VIEWS as T_VIEWS

    events = sorted({r["event"] for r in rows if r.get("event") and r["defect"] == "clean"})
    classes = [
        c for d in T_DEFECTS for c in ((d, *(f"clean, {e} at N+1" for e in events)) if d == "clean" else (d,))
    ]
    cols = [(f, d, e) for f, d in T_VIEWS for e in (1, 10)]
    out = []
    for ov in (True, False):
        title = "7 overlapping steps" if ov else "no overlap"
        out.append(
            f"\n**Trainer source, {title}** (share detected / clean-and-passed; `ct`: share of the misses that said "
            '"cannot tell"; runs in brackets)\n'
        )
        out.append(
            "| class | "
            + " | ".join(f"{_view_name(f, 1, d).rsplit(',', 1)[0]}, logging {e}" for f, d, e in cols)
            + " |"
        )
        out.append("|---|" + "---|" * len(cols))
        for c in classes:
            cells = []
            for f, d, e in cols:
                sel = [
                    r
                    for r in rows
                    if _trainer_class(r) == c
                    and r["overlap"] == ov
                    and (r["format"], r["deterministic"], r["every"]) == (f, d, e)
                ]
                if not sel:
                    cells.append("-")
                    continue
                clean = sel[0]["defect"] in T_CLEAN
                if not clean:
                    sel = [r for r in sel if not _no_effect(r)] or sel
                if sel[0]["defect"] == "clean_nondeterministic" and d is True:
                    cells.append(
                        f"fails {100 * sum(r['exit'] == 1 for r in sel) / len(sel):.0f}% (forced bitwise) ({len(sel)})"
                    )
                    continue
                hit = sum(r["exit"] == (0 if clean else 1) for r in sel)
                cell = f"{100 * hit / len(sel):.0f}%"
                missed = [r for r in sel if r["exit"] == 0] if not clean else []
                if missed:
                    cell += f", ct {100 * sum(bool(r.get('cannot_tell')) for r in missed) / len(missed):.0f}%"
                cells.append(f"{cell} ({len(sel)})")
            out.append(f"| {c} | " + " | ".join(cells) + " |")
    out.append("\n" + summary("trainer", rows, T_CLEAN))
    return "\n".join(out)


def _no_effect(r: dict) -> bool:
    """A planted defect that changed nothing the runs show (an extra scheduler step on a constant LR): the
    resumed run equals the clean one in loss and LR, so no verifier could see it; left out of the rates."""
    schedule = r["defect"] in ("lr_off_by_one", "lr_halved", "scheduler_lost")
    return schedule and r.get("loss_effect") == 0.0 and r.get("lr_effect") == 0.0


def summary(source: str, rows: list[dict], clean: frozenset[str]) -> str:
    """False alarms over every clean verdict, and per (view, class) whether detection reaches 95%: the
    classes below it in a view are that view's undecidable ones, with the share that said "cannot tell"."""
    fp = [r for r in rows if r["defect"] in clean and not _forced(r)]
    bad = [r for r in fp if r["exit"] != 0]
    out = [
        f"{source} source: false positives {len(bad)} / {len(fp)} clean verdicts ({100 * len(bad) / max(1, len(fp)):.1f}%)"
    ]
    for r in bad[:10]:
        out.append(
            f"  FP: {r['defect']} seed {r['seed']} {r.get('scheduler', r.get('size'))} overlap={r['overlap']} "
            f"{r['format']} det={r['deterministic']} every={r['every']}: {r['causes']}"
        )
    views = sorted({(r["format"], str(r["deterministic"]), r["overlap"], r["every"]) for r in rows})
    for f, d, ov, every in views:
        ok, low = [], []
        for cls in sorted({r["defect"] for r in rows} - clean):
            sel = [
                r
                for r in rows
                if r["defect"] == cls
                and (r["format"], str(r["deterministic"]), r["overlap"], r["every"]) == (f, d, ov, every)
            ]
            sel = [r for r in sel if not _no_effect(r)]
            if not sel:
                continue
            rate = sum(r["exit"] == 1 for r in sel) / len(sel)
            ct = sum(bool(r.get("cannot_tell")) for r in sel if r["exit"] == 0)
            (ok if rate >= 0.95 else low).append(
                f"{cls} {100 * rate:.0f}%" + (f" (cannot tell {ct}/{len(sel)})" if rate < 0.95 else "")
            )
        mode = "overlap" if ov else "no overlap"
        out.append(
            f"  {f} det={d} {mode} every {every}: detected >= 95%: {', '.join(ok) or '-'}; below (undecidable here): "
            f"{', '.join(low) or '-'}"
        )
    return "\n".join(out)


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
    ap.add_argument("--defects", default=",".join(DEFECTS), help="classes to run (both sources)")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "verify_resume_truth.json"
    )
    ap.add_argument("--from-json", type=Path, help="Print the tables of an earlier run's rows.")
    ap.add_argument("--source", choices=("generator", "trainer"), default="generator")
    ap.add_argument(
        "--minutes", type=float, default=1e9, help="trainer source: stop starting trunks after this"
    )
    ap.add_argument("--first-seed", type=int, default=0, help="trainer source: start the grid at this seed")
    ap.add_argument("--extra-seeds", type=int, default=0, help="trainer source: StepLR and curriculum trunks")
    ap.add_argument(
        "--trainer-json", type=Path, help="Also print the Trainer source's tables from these rows."
    )
    ap.add_argument("--views", default="tensorboard,ledger", help="formats judged: tensorboard, ledger or both")
    ap.add_argument("--overlap", choices=("both", "yes", "no"), default="both", help="crash modes run")
    args = ap.parse_args()
    formats = tuple(args.views.split(","))
    overlaps = {"both": (True, False), "yes": (True,), "no": (False,)}[args.overlap]
    if args.source == "trainer":
        out = (
            args.out.with_name("verify_resume_truth_trainer.json")
            if args.out.name == "verify_resume_truth.json"
            else args.out
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        only = tuple(args.defects.split(",")) if args.defects != ",".join(DEFECTS) else None
        print(
            trainer_tables(
                run_trainer(
                    args.seeds, args.minutes, out, args.extra_seeds, args.first_seed, only, formats, overlaps
                )
            )
        )
        return
    if args.from_json:
        rows = json.loads(args.from_json.read_text())
    else:
        rows = run_grid(args.seeds, tuple(args.defects.split(",")), formats, overlaps)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=0))
    if args.trainer_json:
        print(trainer_tables(json.loads(args.trainer_json.read_text())))
    elif args.from_json is None:
        print("(the Trainer source: --source trainer, or --trainer-json ROWS to print both)")
    print(tables(rows))
    print(summary("generator", rows, CLEAN))
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
