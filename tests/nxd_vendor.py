"""The vendored NxD 2.29 source (``tests/vendor/nxd-2.29.tar.xz``, README there): checked and extracted for the tests
that run NxD's own code.

The archive is committed so that the suite needs no network; its sha256 is pinned here, and a mismatch fails loudly
(a changed archive is a changed reference, never silently accepted).
"""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

ARCHIVE = Path(__file__).resolve().parent / "vendor" / "nxd-2.29.tar.xz"
SHA256 = "225b802c3fbb583f0fe55c56b0fb14a835da40d37676fe3ae38aefe93a88d281"
COMMIT = "fbac349b61a3adbb123c2983835af692840ff62f"


def extract(dest: Path) -> Path:
    """Extract the archive under ``dest``; the ``src`` folder to put on ``sys.path`` (and in ``NXD_SRC``)."""
    digest = hashlib.sha256(ARCHIVE.read_bytes()).hexdigest()
    if digest != SHA256:
        raise AssertionError(f"{ARCHIVE}: sha256 {digest}, expected {SHA256} (tests/vendor/README.md)")
    with tarfile.open(ARCHIVE, "r:xz") as tar:
        tar.extractall(dest, filter="data")
    return dest / "src"
