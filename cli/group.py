"""How the outcome of any ``ckpt`` command reaches the user, decided in one place: the command group.

A :class:`~ckpt.errors.CkptError` becomes one stderr line ``ckpt: error: <message>`` and the error's exit code
(2 bad input, 1 a problem found in a checkpoint); Ctrl-C becomes one line ``ckpt: interrupted`` and exit code 130
(128 + SIGINT, what a shell reports for it), SIGTERM too, with "; <what> is complete" when it landed after the
command's output was committed; an ``OSError`` the environment raised (disk full, permission denied)
one line and exit 2; anything else is a bug and keeps its traceback.  Commands just raise.
A library warning becomes one stderr line ``ckpt: warning: <message>`` (not Python's two lines naming our source).
``main()`` and click's test runner both go through the group, so they behave the same.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from ckpt.errors import EXIT_CANNOT_RUN, EXIT_INTERRUPTED, CkptError

#: every user error is exactly one stderr line with this prefix, so that scripts can match one spelling
ERROR_PREFIX = "ckpt: error: "
WARNING_PREFIX = "ckpt: warning: "
INTERRUPTED = "ckpt: interrupted"
INTERRUPTED_EXIT = EXIT_INTERRUPTED


def error_line(exc: BaseException) -> str:
    """The one line a user sees for ``exc``."""
    return f"{ERROR_PREFIX}{exc}"


def _show_warning(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
    click.echo(f"{WARNING_PREFIX}{message}", err=True)


@contextmanager
def reported() -> Iterator[None]:
    """Turn a CkptError or a Ctrl-C into its line on stderr and its exit code (click's ``Exit``)."""
    try:
        yield
    except CkptError as exc:
        click.echo(error_line(exc), err=True)
        raise click.exceptions.Exit(exc.exit_code) from None
    except click.UsageError as exc:
        # click's own "Usage: ... Error: ..." block, in our one-line spelling (unknown command, option, value)
        where = exc.ctx.command_path if exc.ctx is not None else "ckpt"
        click.echo(f"{ERROR_PREFIX}{exc.format_message().rstrip('.')}; see: {where} --help", err=True)
        raise click.exceptions.Exit(EXIT_CANNOT_RUN) from None
    except BrokenPipeError:
        # ``ckpt ls | head``: the reader left; say nothing more (and let nothing flush into the closed pipe)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise click.exceptions.Exit(141) from None
    except OSError as exc:
        # the environment refused (disk full, permission, a path that is a file): not a bug, one line
        where = f"{exc.filename}: " if exc.filename else ""
        click.echo(f"{ERROR_PREFIX}{where}{exc.strerror or exc}", err=True)
        raise click.exceptions.Exit(EXIT_CANNOT_RUN) from None
    except KeyboardInterrupt as exc:
        if sys.stderr.isatty():
            click.echo(err=True)  # past the "^C" the terminal echoed
        # a command that had committed its output says so ("ckpt: interrupted; DST ... is complete")
        click.echo(INTERRUPTED + (f"; {exc}" if isinstance(exc, Interrupted) and str(exc) else ""), err=True)
        raise click.exceptions.Exit(INTERRUPTED_EXIT) from None


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C / SIGTERM that landed after the command's output was committed: its text says what is complete."""


def _stop(signum: int, frame: Any) -> None:
    """SIGINT and SIGTERM: the first raises KeyboardInterrupt in the main thread (the command removes what it had
    not committed); later ones are ignored, so that nothing interrupts that clean-up half-way."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextmanager
def _handle_stops() -> Iterator[None]:
    """:func:`_stop` handles SIGINT and SIGTERM meanwhile (in the main thread; the handlers before are restored)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig, handler in before.items():
        if handler is not signal.SIG_IGN:  # started with it ignored (``nohup``, ``cmd &``): keep that
            signal.signal(sig, _stop)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _not_xla_default(record: Any) -> bool:
    """torch_xla logs ``Defaulting to PJRT_DEVICE=CPU`` on the root logger whenever something imports it (accelerate
    does, under transformers); no ``ckpt`` command computes on an XLA device, so the line says nothing to our user."""
    return not str(record.msg).startswith("Defaulting to PJRT_DEVICE")


class CkptGroup(click.Group):
    """A click group that reports errors and interruptions of its commands (and of its own parsing) as above."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        with reported():  # ``ckpt --help`` / ``--version`` run here, before ``invoke``
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> Any:
        import logging
        import warnings

        logging.getLogger().addFilter(_not_xla_default)

        # SIGTERM (``kill``, a scheduler) ends a command as Ctrl-C does, not mid-write
        with reported(), _handle_stops(), warnings.catch_warnings():  # the command's parsing, imports and work
            warnings.showwarning = _show_warning
            return super().invoke(ctx)
