"""One error hierarchy for the whole tool.

Every error a user can cause (bad path, damaged file, impossible request) is a ``CkptError`` whose message is one
line naming the file / tensor / flag at fault and what was expected.  The CLI turns these into exit code 2 (bad
input) or 1 (a problem found in a checkpoint); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

#: The exit codes of every ``ckpt`` command, one meaning each (the table in ``ckpt --help``, the README and
#: docs/guide.md): sound or equal; damage or a difference found; cannot run (bad usage, unreadable or unsupported
#: input, the environment refused: disk full, permission); interrupted (128 + SIGINT, what a shell reports).
EXIT_OK = 0
EXIT_FOUND = 1
EXIT_CANNOT_RUN = 2
EXIT_INTERRUPTED = 130


class CkptError(Exception):
    """Base class: a problem the user can act on. ``exit_code`` is what the CLI exits with."""

    exit_code = EXIT_CANNOT_RUN


class ManifestError(CkptError):
    """The manifest is missing, unreadable, of an unknown version or inconsistent."""


class StorageError(CkptError):
    """Reading or writing the storage backend failed (after retries)."""


class CorruptionError(CkptError):
    """Data on storage does not match the manifest: wrong size, wrong checksum, missing file."""

    exit_code = EXIT_FOUND


class StateMismatchError(CkptError):
    """The object being restored does not fit the checkpoint (missing/unexpected names, shapes)."""


class ReplicaMismatchError(StateMismatchError):
    """Copies of state that must be identical on several ranks (DDP replicas, TP-replicated norms) differ: a
    desynchronised run.  Nothing was written; saving one copy would silently pick a rank."""


class BaseMismatchError(StateMismatchError):
    """An adapter checkpoint is being restored onto a base model other than the one it was trained on.

    Not a damaged checkpoint: ``CheckpointManager.restore_latest`` raises it instead of falling back to older steps
    (which share the base, so would all fail, and the run would silently start from scratch)."""


class CheckpointExistsError(CkptError):
    """A checkpoint for this step is already committed and overwrite was not requested."""


class LayoutError(CkptError):
    """A parallel layout request is impossible (e.g. TP does not divide the number of heads)."""


class UnsafePickleError(CkptError):
    """A foreign pickle referenced a global that is not on the allow-list; nothing was executed."""


class AsyncSaveError(CkptError):
    """A background save failed; raised at the next save/wait/close. The checkpoint was not committed."""


class SaveRefusedError(AsyncSaveError, StorageError):
    """A save failed because storage refused a write (full disk, over quota, read-only, no permission, no such
    bucket); the message names the step's folder, the file and the reason. The checkpoint was not committed."""
