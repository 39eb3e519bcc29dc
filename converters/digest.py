"""Model digests: one short string per model tensor, cheap to compute from what a checkpoint already stores.

Why: verify-resume must tell whether the weights a run restored are the checkpoint's (and whether a checkpoint holds
an earlier step's weights) without comparing models byte by byte every time.  A tensor's digest is the xxh3-64 of
its *boxes* (offsets, lengths) and, for each box, the xxh3-64 of the box's raw bytes in row-major order:

* our format stores exactly that checksum per chunk (``raw`` codec, docs/format.md "Tensor entry"), so a
  checkpoint's digest comes from its manifest and indexes without reading data (:func:`manifest_digest`); a
  compressed chunk is read and hashed once decoded;
* any other format (HF folder, Trainer ``checkpoint-N``, DCP, NxD tag) is hashed through the conversion engine's
  full view, one whole tensor per box (:func:`source_digest`; ``full_view=True`` does the same for our format and
  NxD tags, whatever their layout);
* a live model is hashed in the boxes of the checkpoint it was restored from (:func:`live_digest`), so the digest of
  a correctly restored model equals the checkpoint's, whatever the checkpoint's chunking.

Two digests of one tensor are comparable only when taken in the same *view*: the same meaning of its name (the
HF/state_dict view, or one Neuron layout's own names and head order), dtype, shape and boxes.  Every digest carries
that per tensor (:func:`tensor_view`); :func:`common_view` keeps the tensors two digests hold in the same view, so
that a checkpoint stored in another layout than the live model's is never read as a failed restore.  Digests made
with different boxes say nothing about equality.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from ckpt.format.codecs import checksum
from ckpt.format.dtypes import dtype_from_name, dtype_name
from ckpt.format.manifest import Box, Manifest

if TYPE_CHECKING:
    import torch

#: digest name -> digest string ("xxh3_64:<16 hex>")
ModelDigest = dict[str, str]
MODEL_ROLES = ("parameter", "buffer")
#: the digest of a tensor that could not be hashed (compared as unknown, never as a difference)
UNKNOWN = "-"
#: the view of full tensors under their HF/state_dict names, unpermuted (a CUDA-layout checkpoint, the conversion
#: engine's full view, a live model restored from either)
HF_VIEW = "hf"
#: dtype pairs (stored, live) whose cast is exact both ways: a live tensor cast back reproduces the stored bytes
_EXACT_WIDENING = {
    ("BF16", "F32"), ("F16", "F32"), ("BF16", "F64"), ("F16", "F64"), ("F32", "F64"),
    ("I8", "I16"), ("I8", "I32"), ("I8", "I64"), ("I16", "I32"), ("I16", "I64"), ("I32", "I64"),
    ("U8", "I16"), ("U8", "I32"), ("U8", "I64"),
}  # fmt: skip


def boxes_digest(items: Iterable[tuple[Box, str]]) -> str:
    """The digest of one tensor from its boxes and each box's raw-bytes checksum (order-free)."""
    h = xxhash.xxh3_64()
    for box, cs in sorted(items, key=lambda it: (it[0].offsets, it[0].lengths)):
        h.update(f"{list(box.offsets)}:{list(box.lengths)}={cs};".encode())
    return f"xxh3_64:{h.hexdigest()}"


def raw_checksum(t: torch.Tensor) -> str:
    """xxh3-64 of a tensor's bytes in row-major order (what our writer checksums for a ``raw`` chunk)."""
    import torch

    host = t.detach()
    if host.device.type != "cpu":
        host = host.cpu()
    raw = host.contiguous().reshape(-1).view(torch.uint8).numpy()
    return checksum(memoryview(raw))


def tensor_digest(t: torch.Tensor) -> str:
    """The digest of a whole tensor (one box)."""
    return boxes_digest([(Box.full(tuple(t.shape)), raw_checksum(t))])


def tensor_view(view: str, dtype: str, shape: Sequence[int], boxes: Iterable[Box] | None = None) -> str:
    """What a tensor's digest was taken over, as a short string: the view its name means something in (:data:`HF_VIEW`
    or a Neuron layout's tag, :func:`manifest_view`), the dtype and shape hashed, and ``whole`` or the boxes'
    signature.  Two digests of one name are comparable iff their views are equal."""
    shape = tuple(int(d) for d in shape)
    bx = sorted((tuple(b.offsets), tuple(b.lengths)) for b in boxes) if boxes is not None else None
    if bx is None or bx == [((0,) * len(shape), shape)]:
        where = "whole"
    else:
        where = "boxes:" + xxhash.xxh3_64(repr(bx).encode()).hexdigest()
    return f"{view} {dtype}{list(shape)} {where}"


def whole(view: str) -> str:
    """The :func:`tensor_view` of the same tensor hashed whole (one box)."""
    return view.rsplit(" ", 1)[0] + " whole" if view else view


def manifest_view(m: Manifest) -> str:
    """The view a checkpoint of ours stores its tensors in: :data:`HF_VIEW` for the CUDA layout (state_dict names,
    full tensors), else a tag of its layout (sizes, kind and the Neuron record: the names, fusions and head order)."""
    from .ckpt import manifest_layout

    if manifest_layout(m) == "cuda":
        return HF_VIEW
    record = json.dumps([dataclasses.asdict(m.layout), m.extra.get("nxd")], sort_keys=True, default=str)
    return f"{m.layout.kind}:{xxhash.xxh3_64(record.encode()).hexdigest()}"


@dataclass(frozen=True)
class CheckpointDigest:
    """A checkpoint's model digest, the signature of the boxes it was made in (:func:`layout_signature`: two
    checkpoints' digests compare only when their layouts are equal) and each tensor's view (:func:`tensor_view`:
    a live digest compares with it tensor by tensor where the views are equal)."""

    tensors: ModelDigest
    layout: str
    views: Mapping[str, str]

    @property
    def hf(self) -> bool:
        """Every tensor in the HF/state_dict view (the conversion engine's full view would show the same names)."""
        return all(v.split(" ", 1)[0] == HF_VIEW for v in self.views.values())


@dataclass(frozen=True)
class LiveDigest:
    """A live model's digest (:func:`live_digest`) and each tensor's view (:func:`tensor_view`), as the ledger's
    restore event records them (``model_digest``, ``model_views``)."""

    tensors: ModelDigest
    views: dict[str, str]


def layout_signature(boxes: Mapping[str, Iterable[Box]]) -> str:
    """xxh3-64 over every tensor's name and boxes: equal for two checkpoints chunked alike."""
    h = xxhash.xxh3_64()
    for name in sorted(boxes):
        for b in sorted(boxes[name], key=lambda b: (b.offsets, b.lengths)):
            h.update(f"{name}:{list(b.offsets)}:{list(b.lengths)};".encode())
    return f"xxh3_64:{h.hexdigest()}"


def manifest_digest(reader: Any) -> CheckpointDigest:
    """The model digest of a checkpoint of ours (``CheckpointReader`` on a full manifest): from the stored chunk
    checksums; a compressed chunk is read and hashed decoded."""
    out: ModelDigest = {}
    boxes: dict[str, list[Box]] = {}
    views: dict[str, str] = {}
    view = manifest_view(reader.manifest)
    for name, e in reader.manifest.tensors.items():
        if e.role not in MODEL_ROLES:
            continue
        items = []
        for s in e.shards:
            if s.codec == "raw":
                items.append((s.box, s.checksum))
            else:
                import torch

                tmp = torch.empty(s.box.lengths, dtype=dtype_from_name(e.dtype))
                reader.read_box_into(name, s.box, tmp)
                items.append((s.box, raw_checksum(tmp)))
        out[name] = boxes_digest(items)
        boxes[name] = [s.box for s in e.shards]
        views[name] = tensor_view(view, e.dtype, e.shape, boxes[name])
    return CheckpointDigest(out, layout_signature(boxes), views)


def source_digest(
    path: str, *, config: Mapping[str, Any] | None = None, full_view: bool = False, **run_options: Any
) -> CheckpointDigest:
    """The model digest of a checkpoint in any format ``ckpt convert`` reads: our format from its manifest; a Neuron
    layout (NxD tag) in the boxes its rank files store (no model config needed); any other through the engine's full
    (HF-named) view.  ``full_view``: through the engine's full view whatever the format (what a live model restored
    through a layout conversion is comparable with; one read of the model).  One tensor at a time."""
    from .formats import detect

    fmt = detect(path, run_options.get("storage_options"))
    if fmt.name == "ckpt" and not full_view:
        from ckpt.format.reader import CheckpointReader

        return manifest_digest(CheckpointReader(path, run_options.get("storage_options")))
    if fmt.name == "nxd" and not full_view:
        return _stored_digest(path, config, run_options)
    from .diff import open_view

    view = open_view(path, config=config, **run_options)
    try:
        tensors: ModelDigest = {}
        views: dict[str, str] = {}
        for name in view.model_names():
            t = view.tensor(name)
            tensors[name] = tensor_digest(t)
            views[name] = tensor_view(HF_VIEW, dtype_name(t.dtype), t.shape)
        full = {name: [Box.full(view.descs[name].shape)] for name in tensors}
        return CheckpointDigest(tensors, layout_signature(full), views)
    finally:
        view.close()


#: the adapter name PEFT leaves out of an adapter file's tensor names: ``save_pretrained`` writes the ``default``
#: adapter at the folder's top level and any other one in a subfolder of its name
PEFT_DEFAULT_ADAPTER = "default"


def adapter_digest(path: str) -> CheckpointDigest:
    """The digest of a PEFT adapter folder (``adapter_model.safetensors``, read by :func:`.peft.read_adapter`, the
    bytes as stored) under the names the live ``PeftModel``'s state_dict gives the same tensors:
    ``base_model.model.<module>.lora_A.weight`` in the file is ``base_model.model.<module>.lora_A.default.weight``
    in the model (the folder's top level holds the ``default`` adapter).  What a Trainer checkpoint of a PEFT model
    holds, compared with the restore digest name for name; the frozen base weights are not in it."""
    from .peft import PREFIX, read_adapter

    tensors: ModelDigest = {}
    views: dict[str, str] = {}
    full: dict[str, list[Box]] = {}
    for hf, t in read_adapter(path).tensors.items():  # plain lora_A/lora_B matrices only (others refused)
        live = PREFIX + hf.removesuffix(".weight") + f".{PEFT_DEFAULT_ADAPTER}.weight"
        tensors[live] = tensor_digest(t)
        views[live] = tensor_view(HF_VIEW, dtype_name(t.dtype), t.shape)
        full[live] = [Box.full(tuple(t.shape))]
    return CheckpointDigest(tensors, layout_signature(full), views)


def _stored_digest(
    path: str, config: Mapping[str, Any] | None, run_options: Mapping[str, Any]
) -> CheckpointDigest:
    """An NxD tag's model digest in its own layout: each TP rank's box of a partitioned tensor, one copy of a
    replicated one (NxD names; comparable with tags of the same layout, what a run writes)."""
    from ckpt.layouts import Piece

    from .convert import open_source
    from .options import ConvertOptions, RunOptions

    source = open_source(path, ConvertOptions(to="neuron", config=dict(config) if config else None),
                         RunOptions(**run_options))  # fmt: skip
    try:
        assert source.flags is not None
        out: ModelDigest = {}
        boxes: dict[str, list[Box]] = {}
        views: dict[str, str] = {}
        for name, desc in source.tensors.items():
            if desc.role not in MODEL_ROLES:
                continue
            pp = source.pp_ranks(name)[0]
            local = source.local_shape(desc)
            items = []
            for r in range(source.flags.tp if desc.partition is not None else 1):
                offsets = [0] * len(local)
                if desc.partition is not None:
                    offsets[int(desc.partition["dim"])] = r * local[int(desc.partition["dim"])]
                box = Box(tuple(offsets), tuple(local))
                items.append((box, raw_checksum(source.read(Piece(name, (r, pp), None)))))
            out[name] = boxes_digest(items)
            boxes[name] = [b for b, _ in items]
            views[name] = tensor_view("nxd-tag", desc.dtype, desc.shape, boxes[name])
        return CheckpointDigest(out, layout_signature(boxes), views)
    finally:
        source.close()


def live_digest(model: Any, like: Manifest | None = None) -> LiveDigest:
    """The digest of a live model's parameters and buffers (state_dict names), each hashed in the boxes and dtype
    of the same tensor in ``like`` (the restored checkpoint's full manifest, whose view the model was restored in),
    else whole and as it is, in the HF view.

    A tensor this process does not hold whole (a DTensor shard, a TP rank's part) gets :data:`UNKNOWN`: rank 0 alone
    cannot hash it in the checkpoint's boxes, and comparisons skip it.  A tensor the restore cast lossily (stored
    F32, live BF16) is hashed in its own dtype: its bytes cannot equal the stored ones, and its view says so.
    """
    from torch.distributed.tensor import DTensor

    from ckpt.state.training import model_tensors

    view = manifest_view(like) if like is not None else HF_VIEW
    out: ModelDigest = {}
    views: dict[str, str] = {}
    for nt in model_tensors(model):
        t = nt.tensor
        entry = like.tensors.get(nt.name) if like is not None else None
        if isinstance(t, DTensor) or (entry is not None and tuple(t.shape) != tuple(entry.shape)):
            out[nt.name] = UNKNOWN
            continue
        host = t.detach().cpu() if t.device.type != "cpu" else t.detach()
        if entry is not None and entry.dtype != dtype_name(host.dtype):
            if (entry.dtype, dtype_name(host.dtype)) in _EXACT_WIDENING:
                host = host.to(dtype_from_name(entry.dtype))
            else:
                entry = None  # a lossy cast at restore: hashed as it is
        these = tuple(s.box for s in entry.shards) if entry is not None else ()
        views[nt.name] = tensor_view(view, dtype_name(host.dtype), host.shape, these or None)
        if not these:
            out[nt.name] = tensor_digest(host)
            continue
        out[nt.name] = boxes_digest(
            (b, raw_checksum(host[b.relative_to(Box.full(tuple(host.shape)))])) for b in these
        )
    return LiveDigest(out, views)


def common_view(
    live: Mapping[str, str], live_views: Mapping[str, str], ckpt: CheckpointDigest, names: Iterable[str]
) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """The ``names`` of a live digest that ``ckpt`` holds in the same view (:func:`tensor_view`): (the checkpoint's
    digests of them, the live ones, the names left over).  Names the live side could not hash are dropped."""
    a: dict[str, str] = {}
    b: dict[str, str] = {}
    rest: list[str] = []
    for n in names:
        if live.get(n, UNKNOWN) == UNKNOWN:
            continue
        v = live_views.get(n)
        if v is not None and ckpt.views.get(n) == v and ckpt.tensors.get(n, UNKNOWN) != UNKNOWN:
            a[n], b[n] = ckpt.tensors[n], live[n]
        else:
            rest.append(n)
    return a, b, rest


@dataclass(frozen=True)
class DigestComparison:
    """Two model digests  compared by name: ``differ`` (both hold it, other values), ``only_a``
    (``a`` holds it, ``b`` does not), ``only_b``; ``total`` is the number of names ``a`` holds."""

    differ: tuple[str, ...]
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    total: int

    @property
    def same(self) -> bool:
        return not (self.differ or self.only_a or self.only_b)

    @property
    def not_matching(self) -> int:
        """Names of ``a`` whose value ``b`` does not reproduce (different, or absent from ``b``)."""
        return len(self.differ) + len(self.only_a)


def compare_digests(a: Mapping[str, str], b: Mapping[str, str]) -> DigestComparison:
    """Compare two model digests name by name (made in the same boxes: :class:`CheckpointDigest`); a tensor either
    side could not hash (:data:`UNKNOWN`) is not compared."""
    differ = tuple(n for n in a if n in b and a[n] != b[n] and UNKNOWN not in (a[n], b[n]))
    return DigestComparison(
        differ=differ,
        only_a=tuple(n for n in a if n not in b),
        only_b=tuple(n for n in b if n not in a),
        total=sum(v != UNKNOWN and b.get(n) != UNKNOWN for n, v in a.items()),
    )


__all__ = [
    "adapter_digest",
    "DigestComparison",
    "compare_digests",
    "CheckpointDigest",
    "HF_VIEW",
    "LiveDigest",
    "ModelDigest",
    "UNKNOWN",
    "boxes_digest",
    "common_view",
    "live_digest",
    "manifest_digest",
    "manifest_view",
    "raw_checksum",
    "layout_signature",
    "source_digest",
    "tensor_digest",
    "tensor_view",
    "whole",
]
