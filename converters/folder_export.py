"""What the exports that write a plain folder (HF, HF Trainer, DCP) share: a folder transaction the coordinator
begins (:func:`ckpt.storage.folder.begin_folder`), checks at the commit and drops on abort, and files streamed
whole, one buffer at a time, with nothing held between tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckpt.errors import CkptError
from ckpt.storage.folder import FolderTxn, begin_folder

from .engine import OutPart, Staging


class FolderExport:
    """The begin / commit check / abort of an :class:`~converters.engine.Export` whose output is one folder."""

    storage_options: dict[str, Any] | None = None
    _txn: FolderTxn | None = None

    def begin(self, dst: str) -> Staging:
        self._txn = begin_folder(dst, self.storage_options)
        return Staging(self._txn.url, "")

    def begun(self, staging: Staging, dst: str) -> FolderTxn:
        """The transaction :meth:`begin` opened for ``staging``; a commit by an export that did not is refused."""
        if self._txn is None or self._txn.url != staging.url:
            raise CkptError(f"{dst}: commit by an export that did not begin this folder")
        return self._txn

    def held_bytes(self, retained: Callable[[OutPart], int]) -> int:
        """Nothing: each tensor is written as soon as it is made (a strided view is copied first, which its
        part's ``retained`` counts)."""
        return 0

    def abort(self, staging: Staging) -> None:
        if self._txn is not None:
            self._txn.abort()


def write_all(f: Any, data: Any) -> int:
    """Write the whole buffer ``data`` to ``f``, however little each ``write`` takes; returns its byte count."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += f.write(view[done:])
    return done


__all__ = ["FolderExport", "write_all"]
