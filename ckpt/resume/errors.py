"""Errors of the resume verifier: all bad input (exit code 2), one line naming the file and the fix."""

from __future__ import annotations

from ckpt.errors import CkptError


class RunInputError(CkptError):
    """The run directory or a log in it is missing, empty, malformed or ambiguous."""

    exit_code = 2


class LedgerWriteError(CkptError):
    """The ledger cannot be opened or written (permissions, full disk, closed writer)."""

    exit_code = 2
