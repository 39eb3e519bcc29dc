#!/usr/bin/env bash
# One-GPU check of the CUDA path (issues 11, 28 and 38), in about 15 minutes; prints one JSON object at the end.
#
#   bash bench/gpu_check.sh            # PYTHON=... to pick the interpreter (default .venv/bin/python, else python3)
#
# 1. the CUDA-marked tests (tests/test_lazy_staging_cuda.py): no host synchronize inside save() (sync debug mode
#    "error"), saved bytes = state at save() time with step/edits right after, restore through pinned batched H2D;
# 2. bench/bench_stall.py on CUDA tensors (2 GiB of params + Adam state): ckpt lazy / eager vs DCP async_save
#    (staging in the call) and DCP async_save with DefaultStager (pinned memory, background staging), plus the D2H
#    bandwidth of one plain pinned copy of the same bytes;
# 3. bench/bench_inloop.py on CUDA state (issue 28): the training step's overhead per save in the loop, ckpt (writer
#    process with direct I/O, the same through the page cache, writer thread) vs DCP async_save with and without
#    its pinned DefaultStager vs no checkpoints, at 2 GiB, a save every step and every 10 steps, and background
#    CPU s/GiB vs a bare copy + write.
# 4. the host-memory tier every step (issue 38): bench/bench_inloop.py --savers none,mem,ckpt,dcp at 2 GiB of CUDA
#    state, a save every step and every 10 steps (``mem``: CheckpointManager(local_dir=<in /dev/shm>,
#    local_memory=True): the slot arenas page-locked in place with cudaHostRegister, D2H on the side stream).
#
# Without a GPU (CUDA=0, or torch sees none) it runs the CPU fallback: no CUDA tests, the stall and in-loop benches
# on CPU tensors at a small size, so the script itself is checked anywhere.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
CUDA=${CUDA:-$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)}
if [ "$CUDA" = 1 ]; then
  DEV=cuda STALL_ARGS="--state-mib 2048 --width 4096 --batch 4096" INLOOP_ARGS="--sizes 2 --batch 4096 --rounds 2"
else
  echo "gpu_check: no CUDA device: CPU fallback (small sizes, no CUDA tests)" >&2
  DEV=cpu STALL_ARGS="--state-mib 64 --width 512 --batch 8" INLOOP_ARGS="--sizes 0.05 --batch 8 --rounds 1 --saves 1 --saves-every-step 2"
fi
if [ "$CUDA" = 1 ]; then
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_lazy_staging_cuda.py \
  --junitxml="$OUT/cuda_tests.xml" >"$OUT/cuda_tests.log" 2>&1
tests_rc=$?
tail -5 "$OUT/cuda_tests.log" >&2
else
tests_rc=0
fi
# shellcheck disable=SC2086 # the argument lists are meant to split
timeout 300 "$PY" bench/bench_stall.py --device "$DEV" $STALL_ARGS \
  --every 4 --saves 3 --every-step 6 --out "$OUT/stall_cuda.json" >"$OUT/stall_cuda.log" 2>&1
bench_rc=$?
tail -12 "$OUT/stall_cuda.log" >&2
# shellcheck disable=SC2086
timeout 360 "$PY" bench/bench_inloop.py --device "$DEV" $INLOOP_ARGS --every 1,10 \
  --out "$OUT/inloop_cuda.json" >"$OUT/inloop_cuda.log" 2>&1
inloop_rc=$?
grep -v -i -e warn -e gloo "$OUT/inloop_cuda.log" | tail -20 >&2
# shellcheck disable=SC2086
timeout 360 "$PY" bench/bench_inloop.py --device "$DEV" $INLOOP_ARGS --every 1,10 --savers none,mem,ckpt,dcp \
  --out "$OUT/every_step_cuda.json" >"$OUT/every_step_cuda.log" 2>&1
every_rc=$?
grep -v -i -e warn -e gloo "$OUT/every_step_cuda.log" | tail -12 >&2
"$PY" - "$OUT" "$tests_rc" "$bench_rc" "$inloop_rc" "$DEV" "$every_rc" <<'PYEOF'
import json, os, sys
import xml.etree.ElementTree as ET
out, tests_rc, bench_rc, inloop_rc, dev = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
every_rc = int(sys.argv[6])
res = {"device": dev, "tests_rc": tests_rc, "bench_rc": bench_rc, "inloop_rc": inloop_rc, "every_rc": every_rc}
try:
    s = ET.parse(os.path.join(out, "cuda_tests.xml")).getroot()
    s = s if s.tag == "testsuite" else s[0]
    res["tests"] = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except (OSError, ET.ParseError, IndexError):
    res["tests"] = "skipped: no CUDA device" if dev == "cpu" else None
try:
    with open(os.path.join(out, "stall_cuda.json")) as f:
        b = json.load(f)
    res["d2h_pinned_gbps"] = b.get("d2h_pinned_gbps")
    res["state_bytes"] = b["state_bytes"]
    res["step_s_no_checkpoint"] = b["step_s_no_checkpoint"]
    res["savers"] = {
        k: {f: v[f] for f in ("stall_s", "stall_ms_per_gib", "stall_vs_dcp", "overhead_every_step")}
        for k, v in b["savers"].items()
    }
    res["goals"] = b.get("goals")
except (OSError, KeyError, ValueError):
    res["savers"] = None
keep = ("overhead_per_save_s", "overhead_pct", "train_cpu_overhead_pct", "vs_dcp", "vs_dcp_stager",
        "bg_cpu_s_per_gib", "bg_cpu_vs_copy_write")
for name, fname in (("inloop", "inloop_cuda.json"), ("every_step", "every_step_cuda.json")):
    try:
        with open(os.path.join(out, fname)) as f:
            b = json.load(f)
        res[name] = {
            f"{size} GiB every {every}": {
                "step_s": e["step_s"],
                **{n: {k: r.get(k) for k in keep} for n, r in e["savers"].items() if n != "none"},
            }
            for size, s in b["sizes"].items()
            for every, e in s["by_every"].items()
        }
    except (OSError, KeyError, ValueError):
        res[name] = None
print(json.dumps(res, indent=2))
PYEOF
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$inloop_rc" -eq 0 ] && [ "$every_rc" -eq 0 ]
