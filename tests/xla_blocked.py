"""Run test code in a fresh interpreter in which ``import torch_xla`` fails, and prove it was never imported.

Reading NxD checkpoints must not need torch_xla; this is how the tests show it.
"""

from __future__ import annotations

import subprocess
import sys

_PRELUDE = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch_xla" or name.startswith("torch_xla."):
            raise ImportError("torch_xla blocked by test")
sys.meta_path.insert(0, _Block())
from ckpt.converters import nxd
"""
_EPILOGUE = """
assert not any(m == "torch_xla" or m.startswith("torch_xla.") for m in sys.modules), "torch_xla imported"
print("ok")
"""


def run_without_torch_xla(body: str) -> None:
    """Execute ``body`` (which may use ``nxd``) with torch_xla blocked; fail the test on any error."""
    out = subprocess.run(
        [sys.executable, "-c", _PRELUDE + body + _EPILOGUE], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok" in out.stdout
