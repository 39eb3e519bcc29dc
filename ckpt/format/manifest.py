"""The manifest: one JSON document per checkpoint, the single source of truth (spec: docs/format.md).

A checkpoint exists if and only if its manifest is present and valid.  This module owns the :class:`Manifest`, its
one ``to_json``/``from_json`` pair (version 1 whole; version 2's own members parsed by :mod:`ckpt.format.placement`),
the version check, and structural validation so that nothing downstream trusts a field it has not checked (paths
cannot escape the checkpoint, shard boxes lie inside their tensor, sizes are non-negative integers).  The
dataclasses a manifest is made of, and its seal, are :mod:`ckpt.format.schema`'s (re-exported here).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ManifestError
from .codecs import check_checksum_format, check_codec
from .dtypes import itemsize
from .placement import parse_top
from .schema import (
    BACKENDS,
    FORMAT,
    FORMAT_VERSION,
    JSON,
    MANIFEST_NAME,
    ROLES,
    SEAL_HEAD,
    SEAL_LEN,
    SEAL_RE,
    Box,
    FileEntry,
    Layout,
    Shard,
    TensorDesc,
    TensorEntry,
    check_relpath,
    need_field,
    nonneg_int,
    seal,
    verify_seal,
)

#: The members of a manifest that are trees the saver recorded as they are (taken from a tree mapping by name,
#: None when absent): what :func:`tree_members` copies.
TREE_MEMBERS = (
    "optimizer",
    "scheduler",
    "scaler",
    "tokenizer",
    "user",
    "data_position",
    "rng_base",
    "adapter",
)


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
    #: the global data position, independent of the DP size (ckpt.format.data_position.DataPosition); None: not known
    data_position: dict[str, JSON] | None = None
    #: the RNG rule's inputs for a restore on another DP size (ckpt.state.rng.base_record); None: no RNG saved
    rng_base: dict[str, JSON] | None = None
    #: the run that saved it (a CheckpointManager with tiers: ckpt.tiers.runid); None: not recorded (absent)
    run_id: str | None = None
    # format v2 only: pieces per tensor and the index table (ckpt.format.placement.Placement); tensors' shards are
    # empty until the indexes are read (ckpt.format.reader.read_manifest reads them all unless asked not to)
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
            flat, placement = parse_top(doc, source)
            return replace(_from_doc(flat, source), v2=placement)
        return _from_doc(doc, source)


def tree_members(trees: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`TREE_MEMBERS` of a manifest taken from ``trees`` (a parsed document, or the trees a save
    captured), None where absent: the one place that says which members are trees kept as they are."""
    return {k: trees.get(k) for k in TREE_MEMBERS}


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
        **({"run_id": m.run_id} if m.run_id is not None else {}),  # absent unless a run recorded it
    }


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


def _check_header(doc: Any, source: str) -> int:
    """``format`` and ``format_version``: what decides how the rest (checksum included) is to be read."""
    if not isinstance(doc, dict):
        raise ManifestError(f"{source}: expected a JSON object")
    if doc.get("format") != FORMAT:
        raise ManifestError(f"{source}: not a ckpt manifest (format={doc.get('format')!r})")
    version = need_field(doc, "format_version", int, source)
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
    step = nonneg_int(need_field(doc, "step", int, source), f"{source}: step")
    backend = need_field(doc, "backend", str, source)
    if backend not in BACKENDS:
        raise ManifestError(f"{source}: backend {backend!r} is not one of {BACKENDS}")
    lay = need_field(doc, "layout", dict, source)
    mesh = lay.get("mesh")
    if mesh is not None and not isinstance(mesh, dict):
        raise ManifestError(f"{source}: field 'layout.mesh' must be an object or null")
    layout = Layout(
        **{
            k: nonneg_int(lay.get(k, 1 if k != "zero_stage" else 0), f"{source}: layout.{k}")
            for k in ("world_size", "tp", "pp", "dp", "ep", "zero_stage")
        },
        mesh=mesh,
        kind=need_field(lay, "kind", str, f"{source}: layout") if "kind" in lay else "replicated",
    )
    files: dict[str, FileEntry] = {}
    for path, f in need_field(doc, "files", dict, source).items():
        where = f"{source}: files[{path!r}]"
        check_relpath(path, where)
        if not isinstance(f, dict):
            raise ManifestError(f"{where}: expected an object")
        files[path] = FileEntry(
            path, nonneg_int(f.get("size"), f"{where}.size"), nonneg_int(f.get("rank"), f"{where}.rank")
        )
    tensors: dict[str, TensorEntry] = {}
    for name, t in need_field(doc, "tensors", dict, source).items():
        tensors[name] = _tensor_from_doc(name, t, files, source)
    for key in ("optimizer", "tokenizer", "data_position", "rng_base", "adapter"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            raise ManifestError(f"{source}: field {key!r} must be an object or null")
    for key in ("rng", "progress", "data", "environment", "extra"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            raise ManifestError(f"{source}: field {key!r} must be an object")
    created_at = need_field(doc, "created_at", str, source) if "created_at" in doc else ""
    run_id = doc.get("run_id")
    if run_id is not None and not isinstance(run_id, str):
        raise ManifestError(f"{source}: field 'run_id' must be a string or null, got {type(run_id).__name__}")
    checked = {
        **doc,
        "adapter": _adapter_from_doc(doc.get("adapter"), source),
        "data_position": _data_position(doc.get("data_position"), source),
        "rng_base": _rng_base(doc.get("rng_base"), source),
    }
    return Manifest(
        step, created_at, backend, layout, tensors, files,
        **tree_members(checked),
        rng=doc.get("rng") or {},
        progress=doc.get("progress") or {},
        data=doc.get("data") or {},
        environment=doc.get("environment") or {},
        extra=doc.get("extra") or {},
        run_id=run_id,
        format_version=version,
    )  # fmt: skip


def _data_position(value: Any, source: str) -> dict[str, JSON] | None:
    """Validated (ckpt.format.data_position.DataPosition.from_json raises ManifestError naming the field), kept as JSON."""
    if value is None:
        return None
    from .data_position import DataPosition

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
    role = need_field(t, "role", str, where)
    if role not in ROLES:
        raise ManifestError(f"{where}: role {role!r} is not one of {ROLES}")
    shape = tuple(nonneg_int(d, f"{where}.shape") for d in need_field(t, "shape", list, where))
    if len(shape) > 64 or math.prod(shape) > 1 << 50:
        raise ManifestError(f"{where}: absurd shape {list(shape)}")
    dtype = need_field(t, "dtype", str, where)
    size = _named(itemsize, dtype, where)
    shards = []
    for i, s in enumerate(need_field(t, "shards", list, where)):
        sw = f"{where} shard {i}"
        if not isinstance(s, dict):
            raise ManifestError(f"{sw}: expected an object")
        file = check_relpath(need_field(s, "file", str, sw), sw)
        if file not in files:
            raise ManifestError(f"{sw}: file {file!r} is not listed in 'files'")
        offsets = tuple(nonneg_int(v, f"{sw}.offsets") for v in need_field(s, "offsets", list, sw))
        lengths = tuple(nonneg_int(v, f"{sw}.lengths") for v in need_field(s, "lengths", list, sw))
        if len(offsets) != len(shape) or len(lengths) != len(shape):
            raise ManifestError(
                f"{sw}: box rank {len(offsets)}/{len(lengths)} does not match shape {list(shape)}"
            )
        if any(o + n > d for o, n, d in zip(offsets, lengths, shape, strict=True)):
            raise ManifestError(f"{sw}: box {list(offsets)}+{list(lengths)} lies outside shape {list(shape)}")
        offset = nonneg_int(need_field(s, "offset", int, sw), f"{sw}.offset")
        nbytes = nonneg_int(need_field(s, "nbytes", int, sw), f"{sw}.nbytes")
        codec = _named(check_codec, need_field(s, "codec", str, sw), sw)
        if codec == "raw" and nbytes != math.prod(lengths) * size:
            raise ManifestError(
                f"{sw}: nbytes {nbytes} does not match its box ({math.prod(lengths) * size} bytes)"
            )
        if offset + nbytes > files[file].size:
            raise ManifestError(
                f"{sw}: bytes {offset}..{offset + nbytes} lie outside {file} ({files[file].size} bytes)"
            )
        checksum = need_field(s, "checksum", str, sw)
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


__all__ = [
    "BACKENDS",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ROLES",
    "SEAL_HEAD",
    "SEAL_LEN",
    "SEAL_RE",
    "TREE_MEMBERS",
    "Box",
    "FileEntry",
    "Layout",
    "Manifest",
    "Shard",
    "TensorDesc",
    "TensorEntry",
    "check_relpath",
    "manifest_doc",
    "tree_members",
    "seal",
    "verify_seal",
]
