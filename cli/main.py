"""The ``ckpt`` command: a click group; each command lives in its own module and stays thin.

Exit codes (:data:`.common.EXIT_TABLE`, shown by ``ckpt --help``): 0 sound or equal, 1 damage or a difference
found, 2 cannot run (bad usage, unreadable or unsupported input), 130 interrupted (Ctrl-C).  Errors are one line on stderr, never a traceback
(:mod:`.group`).  The command modules import only click at the top; what a command needs (torch above all) is
imported when it runs, so ``ckpt --help`` and the commands that touch no tensor start fast.
"""

from __future__ import annotations

import click

from . import demo, inspect_cmd, ls, verify
from .common import EXIT_TABLE
from .compare import compare
from .convert import convert
from .diff import diff
from .group import INTERRUPTED_EXIT, CkptGroup
from .report import report
from .verify_resume import verify_resume


@click.group(
    cls=CkptGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
    epilog=EXIT_TABLE,
)
@click.version_option(package_name="ckpt", prog_name="ckpt")
def cli() -> None:
    """Distributed checkpoints for Trainium (Neuron) and CUDA training: save, inspect, verify, convert, resume."""


cli.add_command(ls.ls)
cli.add_command(inspect_cmd.inspect)
cli.add_command(verify.verify)
cli.add_command(convert)
cli.add_command(diff)
cli.add_command(demo.demo)
cli.add_command(verify_resume)
cli.add_command(report)
cli.add_command(compare)


def main(argv: list[str] | None = None) -> None:
    """Run ``ckpt`` with ``argv`` (default: the process's arguments); exits the process.

    An interrupted command has removed what it had not committed and said so by the time it gets here: the
    process then ends at once, not after joining whatever threads a library left running (a pool's manager thread
    whose worker was killed can wait forever)."""
    try:
        cli.main(args=argv, prog_name="ckpt")
    except SystemExit as e:
        if e.code != INTERRUPTED_EXIT:
            raise
        import os
        import sys

        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is not None:  # its semaphores unregistered, its (dead) workers reaped: no tracker warning
            mp_util._exit_function()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(INTERRUPTED_EXIT)
