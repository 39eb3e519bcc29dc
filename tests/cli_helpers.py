"""Running the real ``ckpt`` command in a subprocess, as a user does, and the checks every CLI test makes.

A user error must be exactly one stderr line ``ckpt: error: ...`` (no traceback) with exit code 2 (1 for damage
found), and must leave the destination as it was: :func:`tree` snapshots a folder so a test can compare.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "nxd" / "llama_gqa_h64"


def ckpt_cli(
    *args: str | os.PathLike[str],
    cwd: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``python -m ckpt ARGS`` in a fresh process (stdout/stderr captured, not a terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "ckpt", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "PJRT_DEVICE": "CPU", **(env or {})},
    )


def assert_one_error(r: subprocess.CompletedProcess, *needles: str, code: int = 2) -> str:
    """Exit ``code``, stderr exactly one ``ckpt: error:`` line holding every needle, no traceback."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def tree(p: str | os.PathLike[str]) -> dict[str, int]:
    """Every file under ``p`` with its size (empty when ``p`` does not exist)."""
    p = Path(p)
    if not p.exists():
        return {}
    if p.is_file():
        return {p.name: p.stat().st_size}
    return {str(x.relative_to(p)): x.stat().st_size for x in sorted(p.rglob("*")) if x.is_file()}
