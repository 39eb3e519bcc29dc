"""The Trainium-stack test environment (README.md here): optimum-neuron's and NxD's own code importable on the CPU.

Runs only in ``.venv-trainium`` (``.ci/trainium-stack``), never in the main suite (``testpaths`` is ``tests``).
At import, before any test module imports ``optimum.neuron``: NxD 2.29's ``src/`` is extracted from the vendored
archive (sha256 pinned) into a cache folder, and it and ``tests/nxd_shim`` (the stand-ins, its README) are put on
``sys.path`` and ``PYTHONPATH`` so that spawned rank processes see the same.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ARCHIVE = HERE / "vendor" / "nxd-2.29-src.tar.xz"
SHA256 = "19e0e5b12a5f4579df7959017973e395f54f0fd245672f1eb474f7cdc99516af"
COMMIT = "fbac349b61a3adbb123c2983835af692840ff62f"
SHIM = ROOT / "tests" / "nxd_shim"


def _extracted() -> Path:
    """The NxD checkout root (``src/``, ``examples/training/llama``), extracted once per archive digest."""
    digest = hashlib.sha256(ARCHIVE.read_bytes()).hexdigest()
    if digest != SHA256:
        raise AssertionError(f"{ARCHIVE}: sha256 {digest}, expected {SHA256} (tests_trainium/README.md)")
    dest = Path(tempfile.gettempdir()) / f"ckpt-nxd-{digest[:16]}"
    if not (dest / ".complete").exists():
        part = Path(tempfile.mkdtemp(prefix="ckpt-nxd-", dir=dest.parent))
        with tarfile.open(ARCHIVE, "r:xz") as tar:
            tar.extractall(part, filter="data")
        (part / ".complete").touch()
        try:
            part.rename(dest)
        except OSError:  # another process extracted it first
            pass
    return dest


NXD_ROOT = _extracted()
NXD_SRC = NXD_ROOT / "src"
os.environ.update(NXD_CPU_MODE="1", NXD_SRC=str(NXD_SRC), PJRT_DEVICE="CPU")
os.environ.setdefault("NXD_SHIM_PLATFORM", "trn1")
for p in (str(NXD_SRC), str(SHIM)):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(SHIM), str(NXD_SRC), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)
if str(ROOT / "tests") not in sys.path:
    sys.path.append(str(ROOT / "tests"))
