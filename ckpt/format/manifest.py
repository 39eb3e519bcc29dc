"""The manifest: one JSON document per checkpoint, the single source of truth (spec: docs/format.md).

A checkpoint exists if and only if its manifest is present and valid.  This module owns the schema: frozen
dataclasses, one ``to_json``/``from_json`` pair, the version check, and structural validation so that nothing
downstream trusts a field it has not checked (paths cannot escape the checkpoint, shard boxes lie inside their
tensor, sizes are non-negative integers).
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ManifestError
from .codecs import check_checksum_format, check_codec
from .codecs import checksum as checksum_of
from .dtypes import itemsize

FORMAT = "ckpt"
FORMAT_VERSION = (
    2  # the newest version this ckpt reads (the version written: ckpt.format.index.DEFAULT_FORMAT_VERSION)
)
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
    """How the saving job was parallelised. Sizes are 1 where a kind of parallelism was not used."""

    world_size: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    zero_stage: int = 0
    mesh: dict[str, JSON] | None = None
    kind: str = "replicated"


@dataclass(frozen=True)
class Manifest:
    step: int
    created_at: str
    backend: str
    layout: Layout
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    optimizer: dict[str, JSON] | None = None
    scheduler: JSON = None
    scaler: JSON = None
    rng: dict[str, JSON] = field(default_factory=dict)
    progress: dict[str, JSON] = field(default_factory=dict)
    data: dict[str, JSON] = field(default_factory=dict)
    tokenizer: dict[str, JSON] | None = None
    environment: dict[str, JSON] = field(default_factory=dict)
    user: JSON = None
    extra: dict[str, JSON] = field(default_factory=dict)
    #: adapter-only checkpoint: ``{"base": {digest, rank_digests, tensors, bytes, config, source}}`` (docs/format.md)
    adapter: dict[str, JSON] | None = None
    format_version: int = 1
    #: the global data position, independent of the DP size (ckpt.data.position.DataPosition); None: not known
    data_position: dict[str, JSON] | None = None
    #: the RNG rule's inputs for a restore on another DP size (ckpt.state.rng.base_record); None: no RNG saved
    rng_base: dict[str, JSON] | None = None
    # format v2 only: pieces per tensor and the index table (ckpt.format.index.Layout2); tensors' shards are empty
    # until the indexes are read (ckpt.format.reader.read_manifest reads them all unless asked not to)
    v2: Any = field(default=None, compare=False, repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> str:
        """Format v1: every shard and every rank's trees in this one document (v2: ckpt.format.index.encode)."""
        doc = manifest_doc(self, version=1)
        doc["tensors"] = {n: _tensor_to_json(t) for n, t in self.tensors.items()}
        return seal(doc)

    @staticmethod
    def from_json(text: str | bytes, source: str = "manifest") -> Manifest:
        """Parse, check format and version, verify the manifest's own checksum, then validate the structure.

        The checksum is checked after the version because a newer version may seal differently, and before
        structural validation so that a damaged manifest is reported as damaged, not as some odd field.
        """
        raw = text.encode() if isinstance(text, str) else bytes(text)
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ManifestError(f"{source}: not valid JSON ({e})") from None
        version = _check_header(doc, source)
        verify_seal(raw, source)
        if version == 2:
            from .index import parse_top

            flat, layout2 = parse_top(doc, source)
            return replace(_from_doc(flat, source), v2=layout2)
        return _from_doc(doc, source)


def manifest_doc(m: Manifest, version: int) -> dict[str, JSON]:
    """The members every version shares (``tensors`` left for the version's encoder to fill)."""
    return {
        "format": FORMAT,
        "format_version": version,
        "step": m.step,
        "created_at": m.created_at,
        "backend": m.backend,
        "layout": _layout_to_json(m.layout),
        "files": {p: {"size": f.size, "rank": f.rank} for p, f in sorted(m.files.items())},
        "tensors": {},
        "optimizer": m.optimizer,
        "scheduler": m.scheduler,
        "scaler": m.scaler,
        "rng": m.rng,
        "progress": m.progress,
        "data": m.data,
        "data_position": m.data_position,
        "rng_base": m.rng_base,
        "tokenizer": m.tokenizer,
        "environment": m.environment,
        "user": m.user,
        "extra": m.extra,
        **(
            {"adapter": m.adapter} if m.adapter is not None else {}
        ),  # absent from full checkpoints, as v1 wrote
    }


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


def _layout_to_json(layout: Layout) -> dict[str, JSON]:
    return {
        "world_size": layout.world_size,
        "tp": layout.tp,
        "pp": layout.pp,
        "dp": layout.dp,
        "ep": layout.ep,
        "zero_stage": layout.zero_stage,
        "mesh": layout.mesh,
        "kind": layout.kind,
    }


def _tensor_to_json(t: TensorEntry) -> dict[str, JSON]:
    out: dict[str, JSON] = {"role": t.role, "shape": list(t.shape), "dtype": t.dtype}
    if t.param is not None:
        out["param"] = t.param
    if t.key is not None:
        out["key"] = t.key
    if t.partition is not None:
        out["partition"] = t.partition
    out["shards"] = [
        {
            "file": s.file,
            "offset": s.offset,
            "nbytes": s.nbytes,
            "offsets": list(s.box.offsets),
            "lengths": list(s.box.lengths),
            "codec": s.codec,
            "checksum": s.checksum,
        }
        for s in t.shards
    ]
    return out


# ---------------------------------------------------------------------------------------------------- reading


def _need(doc: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in doc:
        raise ManifestError(f"{where}: missing field {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ManifestError(f"{where}: field {key!r} must be {name}, got {type(value).__name__}")
    return value


def _nonneg_int(value: Any, where: str) -> int:
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


def _check_header(doc: Any, source: str) -> int:
    """``format`` and ``format_version``: what decides how the rest (checksum included) is to be read."""
    if not isinstance(doc, dict):
        raise ManifestError(f"{source}: expected a JSON object")
    if doc.get("format") != FORMAT:
        raise ManifestError(f"{source}: not a ckpt manifest (format={doc.get('format')!r})")
    version = _need(doc, "format_version", int, source)
    if version > FORMAT_VERSION:
        raise ManifestError(
            f"{source}: format_version {version} is newer than this ckpt understands ({FORMAT_VERSION}); "
            "upgrade ckpt to read it"
        )
    if version < 1:
        raise ManifestError(f"{source}: invalid format_version {version}")
    return version


def _from_doc(doc: Any, source: str) -> Manifest:
    version = _check_header(doc, source)
    step = _nonneg_int(_need(doc, "step", int, source), f"{source}: step")
    backend = _need(doc, "backend", str, source)
    if backend not in BACKENDS:
        raise ManifestError(f"{source}: backend {backend!r} is not one of {BACKENDS}")
    lay = _need(doc, "layout", dict, source)
    mesh = lay.get("mesh")
    if mesh is not None and not isinstance(mesh, dict):
        raise ManifestError(f"{source}: field 'layout.mesh' must be an object or null")
    layout = Layout(
        **{
            k: _nonneg_int(lay.get(k, 1 if k != "zero_stage" else 0), f"{source}: layout.{k}")
            for k in ("world_size", "tp", "pp", "dp", "ep", "zero_stage")
        },
        mesh=mesh,
        kind=_need(lay, "kind", str, f"{source}: layout") if "kind" in lay else "replicated",
    )
    files: dict[str, FileEntry] = {}
    for path, f in _need(doc, "files", dict, source).items():
        where = f"{source}: files[{path!r}]"
        check_relpath(path, where)
        if not isinstance(f, dict):
            raise ManifestError(f"{where}: expected an object")
        files[path] = FileEntry(
            path, _nonneg_int(f.get("size"), f"{where}.size"), _nonneg_int(f.get("rank"), f"{where}.rank")
        )
    tensors: dict[str, TensorEntry] = {}
    for name, t in _need(doc, "tensors", dict, source).items():
        tensors[name] = _tensor_from_doc(name, t, files, source)
    for key in ("optimizer", "tokenizer", "data_position", "rng_base", "adapter"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            raise ManifestError(f"{source}: field {key!r} must be an object or null")
    for key in ("rng", "progress", "data", "environment", "extra"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            raise ManifestError(f"{source}: field {key!r} must be an object")
    created_at = _need(doc, "created_at", str, source) if "created_at" in doc else ""
    return Manifest(
        step=step,
        created_at=created_at,
        backend=backend,
        layout=layout,
        tensors=tensors,
        files=files,
        optimizer=doc.get("optimizer"),
        scheduler=doc.get("scheduler"),
        scaler=doc.get("scaler"),
        rng=doc.get("rng") or {},
        progress=doc.get("progress") or {},
        data=doc.get("data") or {},
        tokenizer=doc.get("tokenizer"),
        environment=doc.get("environment") or {},
        user=doc.get("user"),
        extra=doc.get("extra") or {},
        adapter=_adapter_from_doc(doc.get("adapter"), source),
        format_version=version,
        data_position=_data_position(doc.get("data_position"), source),
        rng_base=_rng_base(doc.get("rng_base"), source),
    )


def _data_position(value: Any, source: str) -> dict[str, JSON] | None:
    """Validated (ckpt.data.position.DataPosition.from_json raises ManifestError naming the field), kept as JSON."""
    if value is None:
        return None
    from ..data.position import DataPosition

    DataPosition.from_json(value, source)
    return value


def _rng_base(value: Any, source: str) -> dict[str, JSON] | None:
    if value is None:
        return None
    where = f"{source}: rng_base"
    for key in ("seed", "dp"):
        v = value.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ManifestError(f"{where}.{key}: expected a non-negative integer, got {v!r}")
    for key in ("rule", "source"):
        if not isinstance(value.get(key), str):
            raise ManifestError(f"{where}.{key}: expected a string, got {value.get(key)!r}")
    shared = value.get("shared")
    if not isinstance(shared, list) or not all(isinstance(x, str) for x in shared):
        raise ManifestError(f"{where}.shared: expected a list of stream names")
    return value


def _adapter_from_doc(value: Any, source: str) -> dict[str, Any] | None:
    if value is None:
        return None
    base = value.get("base")
    if (
        not isinstance(base, dict)
        or "digest" not in base
        or not isinstance(base["digest"], (str, type(None)))
    ):
        raise ManifestError(f"{source}: adapter.base must be an object with a string (or null) digest")
    digests = base.get("rank_digests")
    if digests is not None and (
        not isinstance(digests, list) or not all(isinstance(d, str) for d in digests)
    ):
        raise ManifestError(f"{source}: adapter.base.rank_digests must be a list of strings")
    return value


def _named(check: Any, value: Any, where: str) -> Any:
    """Run a value check whose error does not say where the value came from, and prefix the place (file/tensor)."""
    try:
        return check(value)
    except ManifestError as e:
        raise ManifestError(f"{where}: {e}") from None


def _tensor_from_doc(name: str, t: Any, files: dict[str, FileEntry], source: str) -> TensorEntry:
    where = f"{source}: tensor {name!r}"
    if not isinstance(t, dict):
        raise ManifestError(f"{where}: expected an object")
    role = _need(t, "role", str, where)
    if role not in ROLES:
        raise ManifestError(f"{where}: role {role!r} is not one of {ROLES}")
    shape = tuple(_nonneg_int(d, f"{where}.shape") for d in _need(t, "shape", list, where))
    if len(shape) > 64 or math.prod(shape) > 1 << 50:
        raise ManifestError(f"{where}: absurd shape {list(shape)}")
    dtype = _need(t, "dtype", str, where)
    size = _named(itemsize, dtype, where)
    shards = []
    for i, s in enumerate(_need(t, "shards", list, where)):
        sw = f"{where} shard {i}"
        if not isinstance(s, dict):
            raise ManifestError(f"{sw}: expected an object")
        file = check_relpath(_need(s, "file", str, sw), sw)
        if file not in files:
            raise ManifestError(f"{sw}: file {file!r} is not listed in 'files'")
        offsets = tuple(_nonneg_int(v, f"{sw}.offsets") for v in _need(s, "offsets", list, sw))
        lengths = tuple(_nonneg_int(v, f"{sw}.lengths") for v in _need(s, "lengths", list, sw))
        if len(offsets) != len(shape) or len(lengths) != len(shape):
            raise ManifestError(
                f"{sw}: box rank {len(offsets)}/{len(lengths)} does not match shape {list(shape)}"
            )
        if any(o + n > d for o, n, d in zip(offsets, lengths, shape, strict=True)):
            raise ManifestError(f"{sw}: box {list(offsets)}+{list(lengths)} lies outside shape {list(shape)}")
        offset = _nonneg_int(_need(s, "offset", int, sw), f"{sw}.offset")
        nbytes = _nonneg_int(_need(s, "nbytes", int, sw), f"{sw}.nbytes")
        codec = _named(check_codec, _need(s, "codec", str, sw), sw)
        if codec == "raw" and nbytes != math.prod(lengths) * size:
            raise ManifestError(
                f"{sw}: nbytes {nbytes} does not match its box ({math.prod(lengths) * size} bytes)"
            )
        if offset + nbytes > files[file].size:
            raise ManifestError(
                f"{sw}: bytes {offset}..{offset + nbytes} lie outside {file} ({files[file].size} bytes)"
            )
        checksum = _need(s, "checksum", str, sw)
        if checksum:
            _named(check_checksum_format, checksum, sw)
        shards.append(Shard(file, offset, nbytes, Box(offsets, lengths), codec, checksum))
    param = t.get("param")
    key = t.get("key")
    partition = t.get("partition")
    if param is not None and not isinstance(param, str):
        raise ManifestError(f"{where}: 'param' must be a string")
    if key is not None and not isinstance(key, str):
        raise ManifestError(f"{where}: 'key' must be a string")
    if partition is not None and not isinstance(partition, dict):
        raise ManifestError(f"{where}: 'partition' must be an object")
    return TensorEntry(name, role, shape, dtype, param, key, partition, shards=tuple(shards))
