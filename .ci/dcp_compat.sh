#!/usr/bin/env bash
# Does `ckpt convert --format dcp` output load with the DCP of every supported torch (pyproject: torch>=2.6)?
# Needs the network (PyPI); not part of the pytest suite.  See docs/convert.md, "DCP compatibility".
#
#   .ci/dcp_compat.sh                       # torch 2.6 2.7 2.8 2.9
#   DCP_COMPAT_TORCH="2.6 2.9" .ci/dcp_compat.sh
#   DCP_COMPAT_WHEELS=/tmp/wheels .ci/dcp_compat.sh   # keep (and reuse) the downloaded torch wheels there
#
# 1. The project venv (.venv) makes a small checkpoint and converts it with the real CLI to DCP (serial and
#    --workers 2), dumping the truth (bench/dcp_compat.py make).
# 2. For each torch minor version: a throwaway venv under /tmp with only that torch (latest patch release from
#    PyPI, --no-deps), its pure-Python requirements and safetensors; bench/dcp_compat.py check loads both DCP
#    folders with that torch's torch.distributed.checkpoint.load (no process group) and compares bit for bit,
#    then dcp.save's what it loaded; at the end the project imports each of those (bench/dcp_compat.py readback).
#    PyPI's Linux torch wheels are CUDA builds: their CUDA libraries (only loaded, never used) come from the
#    project venv's nvidia/ packages by symlink when it has them (same CUDA 12 sonames), else from PyPI.
# Everything under /tmp is removed at exit (except DCP_COMPAT_WHEELS).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
VERSIONS="${DCP_COMPAT_TORCH:-2.6 2.7 2.8 2.9}"
WORK="$(mktemp -d /tmp/dcp-compat.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
WHEELS="${DCP_COMPAT_WHEELS:-$WORK/wheels}"
mkdir -p "$WHEELS"
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"

"$PY" bench/dcp_compat.py make "$WORK/data"
NVIDIA="$("$PY" -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)"

results=()
status=0
for v in $VERSIONS; do
  venv="$WORK/venv-$v"
  "$PY" -m venv "$venv"
  pip=("$venv/bin/python" -m pip -q --disable-pip-version-check)
  "${pip[@]}" download --no-deps --only-binary=:all: -d "$WHEELS" "torch==$v.*"
  "${pip[@]}" install --no-deps --no-index --find-links "$WHEELS" "torch==$v.*"
  # torch's own requirements, minus the CUDA libraries and triton (a CPU load needs neither)
  mapfile -t reqs < <("$venv/bin/python" - <<'EOF'
import importlib.metadata as m
for r in m.requires("torch") or []:
    name = r.split(";")[0].strip().lower()
    if "extra ==" in r or name.startswith(("nvidia-", "triton")):
        continue
    print(r)
EOF
)
  if [ -n "$NVIDIA" ] && [ -d "$NVIDIA/nvidia" ]; then
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    ln -s "$NVIDIA/nvidia" "$site/nvidia"
    ln -s "$NVIDIA/nvidia/cusparselt" "$site/cusparselt"  # torch 2.6's rpath: <site>/cusparselt/lib
  else
    mapfile -t -O "${#reqs[@]}" reqs < <("$venv/bin/python" - <<'EOF'
import importlib.metadata as m
for r in m.requires("torch") or []:
    if "extra ==" not in r and r.lower().startswith("nvidia-"):
        print(r)
EOF
)
  fi
  # (pip then warns that torch's CUDA requirements are "not installed": they are linked, or were installed above)
  if ! "${pip[@]}" install "${reqs[@]}" safetensors >"$WORK/pip.log" 2>&1; then
    cat "$WORK/pip.log" >&2
    exit 1
  fi
  if "$venv/bin/python" -W ignore bench/dcp_compat.py check "$WORK/data"; then
    results+=("torch $v: OK")
  else
    results+=("torch $v: FAIL")
    status=1
  fi
  rm -rf "$venv"
done
# the other direction: what each torch's own dcp.save wrote (check saves it) imports with the project
if "$PY" -W ignore bench/dcp_compat.py readback "$WORK/data"; then
  results+=("import of each version's dcp.save: OK")
else
  results+=("import of each version's dcp.save: FAIL")
  status=1
fi
echo "DCP compatibility ($(date -u +%Y-%m-%d)):"
printf '  %s\n' "${results[@]}"
exit $status
