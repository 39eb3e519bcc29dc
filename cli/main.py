"""The ``ckpt`` command: a click group; each command lives in its own module and stays thin.

Exit codes: 0 success, 1 a problem found in a checkpoint (damage, discontinuity), 2 bad input (bad path, not a
checkpoint, impossible request).  Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import sys

import click

from ckpt.errors import CkptError

from . import demo, inspect_cmd, ls, verify
from .common import error_line
from .compare import compare
from .convert import convert
from .report import report
from .verify_resume import verify_resume


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="ckpt", prog_name="ckpt")
def cli() -> None:
    """Distributed checkpoints for Trainium (Neuron) and CUDA training: save, inspect, verify, convert, resume."""


cli.add_command(ls.ls)
cli.add_command(inspect_cmd.inspect)
cli.add_command(verify.verify)
cli.add_command(convert)
cli.add_command(demo.demo)
cli.add_command(verify_resume)
cli.add_command(report)
cli.add_command(compare)


def main(argv: list[str] | None = None) -> None:
    try:
        code = cli.main(args=argv, prog_name="ckpt", standalone_mode=False)
    except click.exceptions.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except CkptError as e:
        click.echo(error_line(e), err=True)
        sys.exit(e.exit_code)
    sys.exit(code if isinstance(code, int) else 0)
