"""Model digests: one short string per model tensor, cheap to compute from what a checkpoint already stores.

Why: verify-resume must tell whether the weights a run restored are the checkpoint's (and whether a checkpoint holds
an earlier step's weights) without comparing models byte by byte every time.  A tensor's digest is the xxh3-64 of
its *boxes* (offsets, lengths) and, for each box, the xxh3-64 of the box's raw bytes in row-major order:

* our format stores exactly that checksum per chunk (``raw`` codec, docs/format.md "Tensor entry"), so a
  checkpoint's digest comes from its manifest and indexes without reading data (:func:`manifest_digest`); a
  compressed chunk is read and hashed once decoded;
* any other format (HF folder, Trainer ``checkpoint-N``, DCP, NxD tag) is hashed through the conversion engine's
  full view, one whole tensor per box (:func:`source_digest`);
* a live model is hashed in the boxes of the checkpoint it is compared with (:func:`live_digest`), so the digest of a
  correctly restored model equals the checkpoint's, whatever the checkpoint's chunking.

Two digests compare per name (:func:`ckpt.converters.diff.compare_digests`); digests made with different boxes
(two checkpoints saved on different numbers of ranks) say nothing about equality: :class:`CheckpointDigest` carries
the boxes' signature.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from ckpt.codecs import checksum
from ckpt.dtypes import dtype_from_name
from ckpt.manifest import Box, Manifest

if TYPE_CHECKING:
    import torch

#: digest name -> digest string ("xxh3_64:<16 hex>")
ModelDigest = dict[str, str]
MODEL_ROLES = ("parameter", "buffer")
#: the digest of a tensor that could not be hashed (compared as unknown, never as a difference)
UNKNOWN = "-"


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


@dataclass(frozen=True)
class CheckpointDigest:
    """A checkpoint's model digest and the signature of the boxes it was made in (:func:`layout_signature`): two
    digests compare only when their layouts are equal."""

    tensors: ModelDigest
    layout: str


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
    return CheckpointDigest(out, layout_signature(boxes))


def source_digest(
    path: str, *, config: Mapping[str, Any] | None = None, **run_options: Any
) -> CheckpointDigest:
    """The model digest of a checkpoint in any format ``ckpt convert`` reads: our format from its manifest; a Neuron
    layout (NxD tag) in the boxes its rank files store (no model config needed); any other through the engine's full
    (HF-named) view.  One tensor at a time."""
    from .formats import detect

    fmt = detect(path, run_options.get("storage_options"))
    if fmt.name == "ckpt":
        from ckpt.reader import CheckpointReader

        return manifest_digest(CheckpointReader(path, run_options.get("storage_options")))
    if fmt.name == "nxd":
        return _stored_digest(path, config, run_options)
    from .diff import open_view

    view = open_view(path, config=config, **run_options)
    try:
        names = view.model_names()
        tensors = {name: tensor_digest(view.tensor(name)) for name in names}
        full = {name: [Box.full(view.descs[name].shape)] for name in names}
        return CheckpointDigest(tensors, layout_signature(full))
    finally:
        view.close()


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
        return CheckpointDigest(out, layout_signature(boxes))
    finally:
        source.close()


def live_digest(model: Any, like: Manifest | None = None) -> ModelDigest:
    """The digest of a live model's parameters and buffers (state_dict names), each hashed in the boxes and dtype
    of the same tensor in ``like`` (the restored checkpoint's full manifest), else whole and as it is.

    A tensor this process does not hold whole (a DTensor shard, a TP rank's part) gets :data:`UNKNOWN`: rank 0 alone
    cannot hash it in the checkpoint's boxes, and comparisons skip it.
    """
    from torch.distributed.tensor import DTensor

    from ckpt.state import model_tensors

    out: ModelDigest = {}
    for nt in model_tensors(model):
        t = nt.tensor
        entry = like.tensors.get(nt.name) if like is not None else None
        if isinstance(t, DTensor) or (entry is not None and tuple(t.shape) != tuple(entry.shape)):
            out[nt.name] = UNKNOWN
            continue
        these = tuple(s.box for s in entry.shards) if entry is not None else ()
        if entry is not None and dtype_from_name(entry.dtype) != t.dtype:
            t = t.detach().to(dtype_from_name(entry.dtype))
        if not these:
            out[nt.name] = tensor_digest(t)
            continue
        host = t.detach().cpu() if t.device.type != "cpu" else t.detach()
        out[nt.name] = boxes_digest(
            (b, raw_checksum(host[b.relative_to(Box.full(tuple(host.shape)))])) for b in these
        )
    return out


__all__ = [
    "CheckpointDigest",
    "ModelDigest",
    "UNKNOWN",
    "boxes_digest",
    "live_digest",
    "manifest_digest",
    "raw_checksum",
    "layout_signature",
    "source_digest",
    "tensor_digest",
]
