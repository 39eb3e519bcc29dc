"""Lightning's log layout: ``<save_dir>/<name>/version_<N>/`` (``lightning_logs/version_0``), one folder per
``Trainer`` run.  A job killed and resumed with ``ckpt_path=`` logs its second session into the next
``version_<N>``, so for ``verify-resume`` the version folders of one logger are the sessions of one run, in
version order (TensorBoardLogger's event files and CSVLogger's ``metrics.csv`` alike)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

VERSION_RE = re.compile(r"version_(\d+)")
#: the file CSVLogger writes in each version folder
METRICS_CSV = "metrics.csv"


def _version(d: Path) -> int | None:
    m = VERSION_RE.fullmatch(d.name)
    return int(m[1]) if m else None


def version_dirs(dirs: Iterable[Path]) -> list[Path] | None:
    """``dirs`` in version order when they are all ``version_<N>`` folders of one Lightning logger, else None."""
    found = set(dirs)
    if not found or len({d.parent for d in found}) != 1 or any(_version(d) is None for d in found):
        return None
    return sorted(found, key=lambda d: _version(d) or 0)


def csv_versions(path: Path) -> list[Path]:
    """CSVLogger's ``metrics.csv`` files under ``path`` (a logger folder, its parent, or one version folder), in
    version order; empty when ``path`` is not laid out that way."""
    for parent in (path, *sorted(d for d in path.iterdir() if d.is_dir())) if path.is_dir() else ():
        dirs = [d for d in parent.iterdir() if d.is_dir() and (d / METRICS_CSV).is_file()]
        ordered = version_dirs(dirs)
        if ordered:
            return [d / METRICS_CSV for d in ordered]
    return []


__all__ = ["METRICS_CSV", "csv_versions", "version_dirs"]
