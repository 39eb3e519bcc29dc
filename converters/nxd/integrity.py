"""Zip CRC32 verification of NxD's ``torch.save`` files.

NxD rank files carry no checksum of their own, and ``torch.load`` does not check the CRC32 that every member of a
``torch.save`` zip records in the zip's central directory: a flipped byte inside tensor data loads as a wrong value
without an error.  :func:`verify_torch_zip` compares each member's bytes with its recorded CRC32 before the file is
loaded, so readers (``read_tag``, ``open_tag(...).model/.optimizer``, ``import_tag``, ``ckpt convert`` from NxD)
refuse such a file with one :class:`~ckpt.errors.CorruptionError` line naming it.

What it costs: one sequential pass over the file (the members are memory-mapped and fed to ``zlib.crc32`` without
copying; torch stores members uncompressed), normally from the page cache that the following ``torch.load`` reads
too.  What it does not cover:

* files that are not zips (legacy, pre-1.6 ``torch.save`` pickles) carry no CRC and are accepted as they are (a
  truncated zip is not a zip either; ``torch.load`` then refuses it);
* zips written with ``torch.utils.serialization.config.save.compute_crc32 = False`` record 0 for every CRC; such a
  file (every non-empty member's CRC 0) is accepted unchecked;
* damage that keeps the CRCs right (a rewritten file, two swapped rank files) is not damage to the zip.
"""

from __future__ import annotations

import mmap
import os
import struct
import zipfile
import zlib
from pathlib import Path

from ckpt.errors import CorruptionError

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile.structFileHeader
_LOCAL_MAGIC = b"PK\003\004"
_CHUNK = 64 << 20


def _fail(path: Path, detail: str, context: str) -> CorruptionError:
    where = f" ({context})" if context else ""
    return CorruptionError(f"{path}: {detail}{where}")


def verify_torch_zip(path: str | os.PathLike[str], *, context: str = "") -> bool:
    """Check every member of the ``torch.save`` zip ``path`` against the CRC32 its central directory records.

    Args:
        path: a ``torch.save`` file.
        context: what the file holds (rank, tensor), added to the error message.

    Returns:
        True when the file is a zip and every CRC matched; False when it was accepted unchecked (not a zip: a legacy
        ``torch.save`` pickle; or a zip written without CRC32s).

    Raises:
        CorruptionError: a member's bytes do not match its CRC32, or the zip's directory points outside the file;
            one line naming the file, the member and ``context``.
        FileNotFoundError: the path does not exist.
    """
    path = Path(path)
    with open(path, "rb") as fh:
        if not zipfile.is_zipfile(fh):
            return False
        fh.seek(0)
        try:
            infos = zipfile.ZipFile(fh).infolist()
        except (zipfile.BadZipFile, ValueError, OSError) as e:
            raise _fail(path, f"unreadable zip directory ({str(e)[:120]})", context) from None
        if infos and all(i.CRC == 0 for i in infos if i.file_size) and any(i.file_size for i in infos):
            return False  # written with compute_crc32=False
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return False
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                for info in infos:
                    _check_member(path, view, size, info, context)
            finally:
                view.release()
    return True


def _check_member(path: Path, view: memoryview, size: int, info: zipfile.ZipInfo, context: str) -> None:
    name = info.filename
    at = info.header_offset
    if at + _LOCAL_HEADER.size > size:
        raise _fail(path, f"zip member {name}: header outside the file (truncated?)", context)
    head = _LOCAL_HEADER.unpack(view[at : at + _LOCAL_HEADER.size])
    if head[0] != _LOCAL_MAGIC:
        raise _fail(path, f"zip member {name}: damaged local header", context)
    start = at + _LOCAL_HEADER.size + head[10] + head[11]
    stored_name = bytes(view[at + _LOCAL_HEADER.size : at + _LOCAL_HEADER.size + head[10]])
    if stored_name.decode("utf-8", "replace") != name:
        raise _fail(path, f"zip member {name}: local header names {stored_name[:80]!r}", context)
    if info.compress_type != zipfile.ZIP_STORED:  # torch never compresses; let zipfile inflate and check
        try:
            with zipfile.ZipFile(path).open(info) as m:
                while m.read(_CHUNK):
                    pass
        except (zipfile.BadZipFile, zlib.error, OSError) as e:
            raise _fail(path, f"zip member {name}: {str(e)[:120]}", context) from None
        return
    end = start + info.compress_size
    if end > size:
        raise _fail(path, f"zip member {name}: data runs past the end of the file (truncated?)", context)
    crc = 0
    for a in range(start, end, _CHUNK):
        crc = zlib.crc32(view[a : min(a + _CHUNK, end)], crc)
    if crc != info.CRC:
        what = "tensor data" if "/data/" in name else "pickle" if name.endswith(".pkl") else "member"
        raise _fail(
            path,
            f"zip CRC32 mismatch in {what} member {name} (stored {info.CRC:08x}, read {crc:08x}): file damaged",
            context,
        )
