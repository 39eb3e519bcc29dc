"""Small helpers shared by the commands: consoles, human-readable sizes and layouts.

(Errors are not the commands' business: they raise, and the group reports, see :mod:`.group`.)
"""

from __future__ import annotations

import sys

from rich.console import Console

from ckpt.errors import EXIT_CANNOT_RUN, EXIT_FOUND, EXIT_INTERRUPTED, EXIT_OK

__all__ = ["EXIT_CANNOT_RUN", "EXIT_FOUND", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_TABLE", "err", "out"]

#: the exit codes of every command (:mod:`ckpt.errors`), as ``ckpt --help`` shows them; the README and
#: docs/guide.md hold the same table (a test compares them)
EXIT_TABLE = f"""\b
Exit codes, the same in every command:
  {EXIT_OK}    sound, or equal: nothing wrong found (ls: listed; convert: written)
  {EXIT_FOUND}    damage or a difference found, each damaged file or differing tensor named
  {EXIT_CANNOT_RUN}    cannot run: bad usage, unreadable or unsupported input, or the environment refused (disk full)
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
"""


class _Console(Console):
    """rich's Console, but a closed pipe (``ckpt inspect X | head``) reaches the command group like any other
    BrokenPipeError (rich would exit 1, which reads as "damage found")."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


# Piped output (logs, CI, tests) gets a wide console so that tables are not cut to 80 columns.
out = _Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err = _Console(stderr=True, highlight=False, soft_wrap=True, width=None if sys.stderr.isatty() else 200)


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def layout_text(layout: object) -> str:
    parts = [
        f"{k}={getattr(layout, k)}"
        for k in ("world_size", "tp", "pp", "dp", "ep")
        if getattr(layout, k) != 1 or k == "world_size"
    ]
    zero = getattr(layout, "zero_stage", 0)
    if zero:
        parts.append(f"zero{zero}")
    return f"{getattr(layout, 'kind', '')} " + " ".join(parts)
