#!/usr/bin/env bash
# One-GPU check of issue 11's CUDA path, in under 8 minutes; prints one JSON object at the end.
#
#   bash bench/gpu_check.sh            # PYTHON=... to pick the interpreter (default .venv/bin/python, else python3)
#
# 1. the CUDA-marked tests (tests/test_lazy_staging_cuda.py): no host synchronize inside save() (sync debug mode
#    "error"), saved bytes = state at save() time with step/edits right after, restore through pinned batched H2D;
# 2. bench/bench_stall.py on CUDA tensors (2 GiB of params + Adam state): ckpt lazy / eager vs DCP async_save
#    (staging in the call) and DCP async_save with DefaultStager (pinned memory, background staging), plus the D2H
#    bandwidth of one plain pinned copy of the same bytes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_lazy_staging_cuda.py \
  --junitxml="$OUT/cuda_tests.xml" >"$OUT/cuda_tests.log" 2>&1
tests_rc=$?
tail -5 "$OUT/cuda_tests.log" >&2
timeout 300 "$PY" bench/bench_stall.py --device cuda --state-mib 2048 --width 4096 --batch 4096 \
  --every 4 --saves 3 --every-step 6 --out "$OUT/stall_cuda.json" >"$OUT/stall_cuda.log" 2>&1
bench_rc=$?
tail -12 "$OUT/stall_cuda.log" >&2
"$PY" - "$OUT" "$tests_rc" "$bench_rc" <<'PYEOF'
import json, os, sys
import xml.etree.ElementTree as ET
out, tests_rc, bench_rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
res = {"tests_rc": tests_rc, "bench_rc": bench_rc}
try:
    s = ET.parse(os.path.join(out, "cuda_tests.xml")).getroot()
    s = s if s.tag == "testsuite" else s[0]
    res["tests"] = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except (OSError, ET.ParseError, IndexError):
    res["tests"] = None
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
print(json.dumps(res, indent=2))
PYEOF
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
