"""The one place where ckpt unpickles foreign files (NxD ``.pt`` files, DCP metadata, ``torch.save`` output).

Threat model: a checkpoint directory is input from somewhere else. A pickle can name any importable callable and
run it while loading (``__reduce__`` -> ``os.system``).  Everything ckpt reads from a foreign pickle therefore goes
through :func:`load_torch_file`, which uses torch's restricted ``weights_only`` unpickler: only tensors, storages,
plain containers, dtypes/sizes and the globals named on an allow-list can be built; anything else is refused before
it is called, and the refusal becomes one :class:`ckpt.errors.UnsafePickleError` line naming the file and the global.

Why this approach and not another:

* ``torch.load(weights_only=True)`` is the only unpickler that also restricts ``REDUCE``/``NEWOBJ``/``BUILD`` to
  allow-listed objects (a plain ``pickle.Unpickler.find_class`` allow-list stops at the global lookup), and it is
  maintained with torch's own storage/tensor rebuild rules.  We do not re-implement it.
* torch_xla's xser files pickle ``torch_xla.utils.serialization.TensorReference`` objects.  Allow-listing the real
  class means importing torch_xla (slow, initialises PJRT, absent on GPU hosts).  torch >= 2.6 accepts allow-list
  entries of the form ``(object, "module.qualname")``: the pickled name is matched as a string and *our* object is
  used instead, so :class:`TensorReference` below stands in for it without torch_xla being imported.
* A custom ``pickle_module`` cannot be combined with ``weights_only=True`` (torch refuses), so that route would lose
  the restricted unpickler; faking ``sys.modules['torch_xla...']`` would break real torch_xla users in the process.
* torch's allow-list is process-global.  Our entries are added only while one of our loads runs (reference-counted
  under a lock, so concurrent loads from several threads do not remove each other's entries) and removed afterwards,
  so other ``torch.load`` callers in the process are not affected between our loads.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import struct
import threading
import zipfile
from collections.abc import Iterator, Mapping
from typing import IO, Any

import torch

from ckpt.errors import UnsafePickleError

__all__ = [
    "XSER_TENSOR_REFERENCE",
    "TensorReference",
    "load_pickle",
    "load_torch_buffer",
    "load_torch_file",
]

#: (module, name) under which torch_xla's xser pickles its tensor placeholders.
XSER_TENSOR_REFERENCE: tuple[str, str] = ("torch_xla.utils.serialization", "TensorReference")


class TensorReference:
    """Stand-in for ``torch_xla.utils.serialization.TensorReference``: a placeholder for tensor number ``tid``.

    The class carries torch_xla's module and qualified name so that :mod:`converters.nxd` can also *write* xser files
    whose pickled global is exactly ``torch_xla.utils.serialization.TensorReference`` (its pickle state, like the
    original's, is ``{"tid": int}``).  ``__setstate__`` accepts nothing else, so a crafted file cannot smuggle other
    attributes through the allow-listed name.
    """

    __module__ = XSER_TENSOR_REFERENCE[0]
    __qualname__ = XSER_TENSOR_REFERENCE[1]

    def __init__(self, tid: int) -> None:
        self.tid = int(tid)

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, dict) and set(state) == {"tid"} and type(state["tid"]) is int):
            raise pickle.UnpicklingError(f"TensorReference state must be {{'tid': int}}, got {state!r:.80}")
        self.tid = state["tid"]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorReference) and other.tid == self.tid

    def __hash__(self) -> int:
        return hash(("TensorReference", self.tid))

    def __repr__(self) -> str:
        return f"TensorReference(tid={self.tid})"


TensorReference.__name__ = XSER_TENSOR_REFERENCE[1]

_DEFAULT_ALLOWED: dict[tuple[str, str], Any] = {XSER_TENSOR_REFERENCE: TensorReference}

_lock = threading.Lock()
_active: dict[tuple[Any, str], list[Any]] = {}  # entry -> [refcount, safe_globals context]


@contextlib.contextmanager
def _allowlisted(allowed: Mapping[tuple[str, str], Any]) -> Iterator[None]:
    """Register ``allowed`` with torch's weights_only allow-list for the duration of the block (ref-counted)."""
    entries = [(obj, f"{module}.{name}") for (module, name), obj in allowed.items()]
    with _lock:
        for entry in entries:
            slot = _active.get(entry)
            if slot is None:
                ctx = torch.serialization.safe_globals([entry])
                ctx.__enter__()
                _active[entry] = [1, ctx]
            else:
                slot[0] += 1
    try:
        yield
    finally:
        with _lock:
            for entry in entries:
                slot = _active[entry]
                slot[0] -= 1
                if slot[0] == 0:
                    del _active[entry]
                    slot[1].__exit__(None, None, None)


_DETAIL_RE = re.compile(r"WeightsUnpickler error:\s*(.*?)(?:\n\n|$)", re.S)
_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def _refused(message: str) -> str:
    """Extract what torch's restricted unpickler refused from its (multi-paragraph) message."""
    m = _DETAIL_RE.search(message)
    detail = m.group(1).strip() if m else message.strip()
    g = _GLOBAL_RE.search(detail)
    if g:
        return f"global {g.group(1)}"
    lines = [ln.strip() for ln in detail.splitlines() if ln.strip()]
    return f"construct ({lines[0][:160]})" if lines else "an unknown construct"


def load_torch_file(
    path_or_fileobj: str | os.PathLike[str] | IO[bytes],
    extra_allowed: Mapping[tuple[str, str], Any] | None = None,
    *,
    mmap: bool = False,
) -> Any:
    """Load a ``torch.save`` file without executing code from it; tensors land on the CPU.

    Args:
        path_or_fileobj: a file path or a binary file object (zip or legacy ``torch.save`` format).
        extra_allowed: more ``(module, name) -> replacement`` globals to accept, on top of torch's own
            weights_only set and ``torch_xla.utils.serialization.TensorReference`` (mapped to
            :class:`TensorReference`).  The replacement is what the unpickler uses; the named module is never imported.
        mmap: memory-map the file's storages instead of reading them (paths to zip-format files only); keeps peak
            memory bounded when only a few tensors of a large file are used.

    Returns:
        The unpickled object.

    Raises:
        UnsafePickleError: the file references a global or construct that is not allow-listed; nothing was called.
        CorruptionError: the file is not a readable torch file.
        FileNotFoundError: the path does not exist.
    """
    from ckpt.errors import CorruptionError

    name = (
        path_or_fileobj
        if isinstance(path_or_fileobj, (str, os.PathLike))
        else getattr(path_or_fileobj, "name", "<stream>")
    )
    allowed = dict(_DEFAULT_ALLOWED)
    if extra_allowed:
        allowed.update(extra_allowed)
    with _allowlisted(allowed):
        try:
            return torch.load(path_or_fileobj, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:
            raise UnsafePickleError(
                f"{os.fspath(name)}: refused to unpickle {_refused(str(e))} (not on the allow-list; nothing was executed)"
            ) from None
        except FileNotFoundError:
            raise
        except (RuntimeError, EOFError, ValueError, OSError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CorruptionError(
                f"{os.fspath(name)}: not a readable torch.save file ({first[:200]})"
            ) from None


class _ViewFile(io.RawIOBase):
    """A read-only, seekable file over a buffer (``zipfile`` reads the archive's directory through it, no copy)."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, pos + (0, self.pos, len(self.view))[whence])
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self.view) - self.pos))
        b[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n


def load_torch_buffer(
    buf: Any,
    offset: int,
    length: int,
    *,
    where: str,
    extra_allowed: Mapping[tuple[str, str], Any] | None = None,
) -> Any:
    """Load the ``torch.save`` zip held in bytes ``[offset, offset + length)`` of ``buf`` (a writable buffer: a
    private ``mmap`` of a file), its tensors as views of ``buf``: nothing is copied, so a tensor stored inside a
    bigger file (a DCP ``.distcp`` item) costs no memory until its pages are read, and then page cache.

    Same safety as :func:`load_torch_file`: the pickle is run by torch's restricted ``weights_only`` unpickler (the
    one ``torch.load`` uses) with the same allow-list; only its storages come from ``buf`` instead of fresh
    allocations.  Records must be stored uncompressed (``torch.save`` never compresses) and little-endian."""
    from ckpt.errors import CorruptionError

    view = memoryview(buf)[offset : offset + length]
    if len(view) != length:
        raise CorruptionError(f"{where}: truncated ({length} bytes at {offset} needed)")
    try:
        zf = zipfile.ZipFile(_ViewFile(view))
        pkl = [n for n in zf.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise CorruptionError(f"{where}: not a torch.save archive (no single data.pkl)")
        prefix = pkl[0][: -len("data.pkl")]
        if prefix + "byteorder" in zf.namelist() and zf.read(prefix + "byteorder") != b"little":
            raise CorruptionError(f"{where}: big-endian torch.save data; expected little-endian")
        data_pkl = zf.read(pkl[0])
    except (zipfile.BadZipFile, zipfile.LargeZipFile, KeyError, EOFError, ValueError, OSError) as e:
        raise CorruptionError(f"{where}: not a readable torch.save archive ({str(e)[:200]})") from None

    def record(key: str, nbytes: int) -> int:
        try:
            info = zf.getinfo(f"{prefix}data/{key}")
        except KeyError:
            raise CorruptionError(f"{where}: storage record data/{key} missing") from None
        if info.compress_type != zipfile.ZIP_STORED or info.file_size < nbytes:
            raise CorruptionError(
                f"{where}: storage record data/{key} is compressed or shorter than {nbytes} bytes"
            )
        head = info.header_offset
        if view[head : head + 4] != b"PK\x03\x04":
            raise CorruptionError(f"{where}: bad local header of data/{key}")
        name_len, extra_len = struct.unpack_from("<HH", view, head + 26)
        start = head + 30 + name_len + extra_len
        if start + info.file_size > length:
            raise CorruptionError(f"{where}: storage record data/{key} runs past the archive")
        return start

    storages: dict[str, Any] = {}

    def persistent_load(pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r:.80}")
        _, storage_type, key, _location, numel = pid
        key = key.decode("ascii") if isinstance(key, bytes) else str(key)
        if key not in storages:
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            nbytes = int(numel) * torch._utils._element_size(dtype)
            start = record(key, nbytes)
            raw = (
                torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset + start)
                if nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
            storages[key] = torch.storage.TypedStorage(
                wrap_storage=raw.untyped_storage(), dtype=dtype, _internal=True
            )
        return storages[key]

    from torch import _weights_only_unpickler

    allowed = dict(_DEFAULT_ALLOWED)
    if extra_allowed:
        allowed.update(extra_allowed)
    with _allowlisted(allowed):
        try:
            unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(data_pkl), encoding="utf-8")
            unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
            return unpickler.load()
        except pickle.UnpicklingError as e:
            raise UnsafePickleError(
                f"{where}: refused to unpickle {_refused(str(e))} (not on the allow-list; nothing was executed)"
            ) from None
        except (RuntimeError, EOFError, ValueError, TypeError, AttributeError, IndexError, struct.error) as e:
            raise CorruptionError(f"{where}: not a readable torch.save archive ({str(e)[:200]})") from None


class _AllowListUnpickler(pickle.Unpickler):
    """``find_class`` restricted to an explicit ``(module, name) -> object`` map; persistent ids refused."""

    def __init__(self, file: IO[bytes], allowed: Mapping[tuple[str, str], Any], where: str) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"{self._where}: refused to unpickle global {module}.{name} (not on the allow-list; nothing was executed)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self._where}: refused a persistent id in a plain pickle")


def load_pickle(
    source: bytes | IO[bytes], allowed: Mapping[tuple[str, str], Any], *, where: str = "<pickle>"
) -> Any:
    """Load a plain pickle (not a ``torch.save`` zip) whose globals must all be in ``allowed``.

    For foreign metadata files that are plain pickles of inert classes (torch DCP's ``.metadata``): torch's
    ``weights_only`` unpickler cannot read them (it rejects protocol-4 opcodes such as ``FRAME`` and
    ``SHORT_BINUNICODE``), so the allow-list is enforced at global lookup.  Only pass classes whose construction and
    ``__setstate__`` have no side effects (dataclasses, ``torch.Size``, dtypes): ``REDUCE``/``BUILD`` can call them
    with arbitrary arguments.
    """
    from ckpt.errors import CorruptionError

    f = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    try:
        return _AllowListUnpickler(f, allowed, where).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as e:
        raise CorruptionError(f"{where}: not a readable pickle ({str(e)[:200]})") from None
