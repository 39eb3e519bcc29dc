"""Small helpers shared by the commands: consoles, the one-line error convention, human-readable sizes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click
from rich.console import Console

from ckpt.errors import CkptError

# Every command reports a user error as exactly one stderr line with this prefix (``main()`` and the commands that
# handle errors themselves share it, so scripts can match one spelling).
ERROR_PREFIX = "ckpt: error: "

# Piped output (logs, CI, tests) gets a wide console so that tables are not cut to 80 columns.
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True, width=None if sys.stderr.isatty() else 200)


def error_line(exc: BaseException) -> str:
    """The one line a user sees for ``exc``."""
    return f"{ERROR_PREFIX}{exc}"


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Turn a CkptError into the one-line message and its exit code inside a command.

    For commands that must behave the same whether run through ``main()`` or invoked directly (click's test
    runner, embedding): without it a direct invocation would surface the exception instead of the message.
    """
    try:
        yield
    except CkptError as exc:
        click.echo(error_line(exc), err=True)
        raise click.exceptions.Exit(exc.exit_code) from None


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
