"""The format's vocabulary: the dataclasses a manifest is made of, its constants, and its seal (spec: docs/format.md).

Both manifest layouts build on this module: the whole manifest of :mod:`ckpt.format.manifest` (version 1, and the
members every version shares) and the per-rank index of :mod:`ckpt.format.index` (version 2).  Nothing here reads
or writes a file.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError
from .codecs import checksum as checksum_of
from .dtypes import itemsize

FORMAT = "ckpt"
#: The format version ckpt writes when not told otherwise (``Checkpointer(format_version=...)``,
#: ``ckpt.format.publish.publish(..., version=...)``) and the newest it reads: the one place that decides it.  2 keeps
#: the top manifest small at any world size; 1 is still written on request and always read.
FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"

# The manifest's own checksum ("seal"): the file starts with this member, and its value is the xxh3-64 of the
# file's bytes with that member cut out (docs/format.md, "Manifest checksum").  Byte-exact on purpose: a reader in
# any language verifies it with a slice and a hash, no JSON canonicalisation (float spelling, escaping, key order)
# to reproduce, and every changed byte is caught, not only those that change the parsed document.
SEAL_HEAD = b'{"checksum":"xxh3_64:'
SEAL_RE = re.compile(rb'\{"checksum":"(xxh3_64:[0-9a-f]{16})",')
SEAL_LEN = len(SEAL_HEAD) + 16 + 2  # head + 16 hex digits + '",'

ROLES = ("parameter", "buffer", "optimizer_state", "state")
BACKENDS = ("cpu", "cuda", "neuron")

JSON = Any


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of a global tensor: ``offsets[i] : offsets[i] + lengths[i]`` on every dim."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    def intersect(self, other: Box) -> Box | None:
        offs, lens = [], []
        for a, la, b, lb in zip(self.offsets, self.lengths, other.offsets, other.lengths, strict=True):
            lo, hi = max(a, b), min(a + la, b + lb)
            if hi <= lo and not (la == 0 and lb == 0):
                return None
            offs.append(lo)
            lens.append(max(hi - lo, 0))
        return Box(tuple(offs), tuple(lens))

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """Slices selecting this box inside a tensor that holds ``outer``."""
        return tuple(
            slice(o - oo, o - oo + n)
            for o, n, oo in zip(self.offsets, self.lengths, outer.offsets, strict=True)
        )

    @staticmethod
    def full(shape: tuple[int, ...]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(shape))


@dataclass(frozen=True)
class Shard:
    """One stored chunk of a logical tensor: where its bytes are and which box of the tensor they hold."""

    file: str
    offset: int
    nbytes: int
    box: Box
    codec: str = "raw"
    checksum: str = ""


@dataclass(frozen=True)
class TensorDesc:
    """What a logical (global) tensor is, independent of where its bytes are: the one tensor descriptor.

    The saver's plan, the commit, the converters' plans and the manifest all describe tensors with it;
    ``dtype`` is the manifest's dtype name (``"F32"``), ``partition`` the Neuron layout's TP split (or None).
    """

    name: str
    role: str
    shape: tuple[int, ...]
    dtype: str
    param: str | None = None
    key: str | None = None
    partition: dict[str, JSON] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def desc(self) -> TensorDesc:
        """Just the description (drops the shards of a :class:`TensorEntry`)."""
        return TensorDesc(self.name, self.role, self.shape, self.dtype, self.param, self.key, self.partition)


@dataclass(frozen=True)
class TensorEntry(TensorDesc):
    """A logical tensor and the shards it was stored as."""

    shards: tuple[Shard, ...] = field(default=(), kw_only=True)

    @classmethod
    def of(cls, desc: TensorDesc, shards: tuple[Shard, ...]) -> TensorEntry:
        return cls(
            desc.name, desc.role, desc.shape, desc.dtype, desc.param, desc.key, desc.partition, shards=shards
        )


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    rank: int


@dataclass(frozen=True)
class Layout:
    """How the saving job was parallelised (the manifest's ``layout``). Sizes are 1 where a kind of parallelism was
    not used; a restore on other sizes reshards from the boxes, so these are facts for tools, not instructions."""

    world_size: int = 1
    #: tensor-, pipeline-, data- and expert-parallel sizes
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    #: 1: the optimizer state was sharded over the DP ranks (ZeRO-1), saved merged by parameter
    zero_stage: int = 0
    #: a DTensor device mesh: ``{"shape": [...], "dim_names": [...]}``
    mesh: dict[str, JSON] | None = None
    #: who described the placements: "replicated", "dtensor" or "nxd"
    kind: str = "replicated"


def seal(doc: dict[str, JSON], *, allow_nan: bool = False) -> str:
    """Serialise a manifest document with its checksum as the first member; the one way manifests are written.

    ``Manifest.to_json`` uses it, and so must anything that writes or edits a manifest by hand (tests, converters,
    repair tools): an edited document that is not re-sealed is refused as damaged.  Any ``"checksum"`` key in
    ``doc`` is replaced.  ``allow_nan`` exists only for fuzzing hostile documents; manifests are strict JSON.
    """
    body = json.dumps(
        {k: v for k, v in doc.items() if k != "checksum"}, allow_nan=allow_nan, separators=(",", ":")
    )
    if body == "{}":
        raise ValueError("cannot seal an empty manifest document")
    digest = checksum_of(body.encode())
    return f'{{"checksum":"{digest}",{body[1:]}'


def verify_seal(raw: bytes, source: str) -> None:
    """Raise ManifestError ("<source> is damaged: ...") unless ``raw`` carries a matching checksum.

    Every manifest is sealed (ckpt has never written one without), so a missing or mangled checksum member is
    damage like any other: no byte of a manifest can change without being noticed.
    """
    m = SEAL_RE.match(raw)
    if m is None:
        raise ManifestError(
            f"{source} is damaged: its checksum is missing or is not the file's first member "
            f'(expected {SEAL_HEAD.decode()}<16 hex digits>",): damaged, or edited by hand without ckpt.format.manifest.seal'
        )
    stored = m.group(1).decode()
    computed = checksum_of(b"{" + raw[SEAL_LEN:])
    if stored != computed:
        raise ManifestError(f"{source} is damaged: checksum mismatch (stored {stored}, computed {computed})")


def need_field(doc: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``doc[key]``, refused (naming ``where`` and the field) when it is missing or not of type ``kind``."""
    if key not in doc:
        raise ManifestError(f"{where}: missing field {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ManifestError(f"{where}: field {key!r} must be {name}, got {type(value).__name__}")
    return value


def nonneg_int(value: Any, where: str) -> int:
    """``value`` when it is a non-negative integer (not a bool), else a ManifestError naming ``where``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ManifestError(f"{where}: expected a non-negative integer, got {value!r}")
    return value


def check_relpath(path: Any, where: str) -> str:
    """A file name inside a checkpoint: relative, normalised, no ``..``, no backslashes or control chars."""
    if (
        not isinstance(path, str)
        or not path
        or path.startswith("/")
        or "\\" in path
        or any(ord(c) < 32 for c in path)
        or posixpath.normpath(path) != path
        or path.split("/")[0] in ("..", ".")
        or ".." in path.split("/")
        or ":" in path
    ):
        raise ManifestError(f"{where}: unsafe file name {path!r}: expected a plain relative path")
    return path


__all__ = [
    "BACKENDS",
    "FORMAT",
    "FORMAT_VERSION",
    "JSON",
    "MANIFEST_NAME",
    "ROLES",
    "SEAL_HEAD",
    "SEAL_LEN",
    "SEAL_RE",
    "Box",
    "FileEntry",
    "Layout",
    "Shard",
    "TensorDesc",
    "TensorEntry",
    "check_relpath",
    "need_field",
    "nonneg_int",
    "seal",
    "verify_seal",
]
