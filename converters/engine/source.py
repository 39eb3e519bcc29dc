"""The source protocol: a checkpoint to convert from describes its tensors and hands out the pieces it stores.

A source never assembles a logical tensor for the engine.  It says what it holds (``tensors``: manifest-style
descriptions in its own naming, with the Neuron ``partition`` of TP-split tensors) and reads *pieces*
(:class:`ckpt.layouts.Piece`) of what it stores: for a Neuron layout, a slice of one (tp, pp) rank's local tensor,
exactly what NxD keeps per rank; for a CUDA layout, a slice of a whole tensor.  The plan says which pieces make
which output, so a TP-split tensor is read once and written once, whatever the container (NxD rank files, our
manifest's boxes, safetensors, DCP chunks).

Conventions for a Neuron-layout source (docs/format.md, "Neuron (NxD) layout"): TP rank ``r`` of a partitioned
tensor holds box ``r`` of ``tp`` equal boxes along ``partition["dim"]``; replicated tensors (no ``partition``) are
whole on every TP rank; ``pp_ranks(name)`` lists the PP ranks holding a model tensor (optimizer states follow their
parameter).  ``flags`` are the source's parallel flags and ``record`` its ``extra.nxd``; the model dimensions
(``spec``) are needed only to change the layout, never to keep it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Mapping
from typing import Any, ClassVar, Literal

import torch

from ckpt.errors import LayoutError
from ckpt.format.dtypes import dtype_from_name
from ckpt.format.manifest import TensorDesc
from ckpt.layouts import LayoutSpec, Piece, TensorMeta
from ckpt.layouts.names import nxd_to_hf_names
from ckpt.layouts.pipeline import pp_ranks_of
from ckpt.layouts.record import NxdRecord
from ckpt.layouts.spec import NxdFlags

from .trees import Trees

LayoutKind = Literal["neuron", "cuda"]
Rank = tuple[int, int]
MODEL_ROLES = ("parameter", "buffer")


class Source(ABC):
    """A checkpoint to convert from (see the module docstring for the contract)."""

    #: the format's name (``ckpt``, ``hf``, ``dcp``, ``nxd``)
    format: ClassVar[str]
    path: str
    layout: LayoutKind
    tensors: dict[str, TensorDesc]
    trees: Trees
    #: the HF ``config.json`` dict when known
    config: dict[str, Any] | None = None
    #: False when SRC's files record no training step (its ``trees.step`` is then a placeholder 0)
    step_recorded: bool = True
    #: Neuron layouts only
    flags: NxdFlags | None = None
    record: NxdRecord | None = None

    @abstractmethod
    def read(self, piece: Piece) -> torch.Tensor:
        """The data of ``piece`` (may be a view of something the source keeps; the caller copies what it keeps)."""

    def locate(self, piece: Piece) -> Hashable:
        """Identity of the stored bytes ``piece`` reads: two pieces with the same identity are the same bytes, so
        comparing them proves nothing (a replicated tensor our manifest stores once, read "from" two ranks)."""
        return piece

    def pp_ranks(self, name: str) -> tuple[int, ...]:
        """PP ranks holding model tensor ``name`` (Neuron layouts)."""
        assert self.flags is not None
        if self.flags.pp == 1:
            return (0,)
        spec = self.spec()
        return pp_ranks_of(nxd_to_hf_names(name, spec.family)[0], spec)

    def spec(self, config: Mapping[str, Any] | None = None) -> LayoutSpec:
        """The full layout (flags + model dims) of a Neuron-layout source; needs the model config."""
        if self.flags is None or self.record is None:
            raise LayoutError(f"{self.path}: a {self.layout}-layout source has no NxD layout")
        f = self.flags
        return self.record.spec(tp=f.tp, pp=f.pp, dp=f.dp, config=config or self.config, where=self.path)

    def local_shape(self, desc: TensorDesc) -> tuple[int, ...]:
        """Shape of one TP rank's part of ``desc`` (all of it when replicated)."""
        shape = list(desc.shape)
        part = desc.partition
        if part is not None:
            tp = self.flags.tp if self.flags is not None else 1
            d = int(part["dim"])
            if d >= len(shape) or shape[d] % tp:
                raise LayoutError(
                    f"{self.path}: {desc.name} has shape {list(desc.shape)}, which tp {tp} does not split along "
                    f"dim {d}"
                )
            shape[d] //= tp
        return tuple(shape)

    def rank_metas(self) -> dict[Rank, dict[str, TensorMeta]]:
        """``{(tp, pp): {name: local meta}}`` of the model tensors (what the layout engine plans from)."""
        assert self.flags is not None
        out: dict[Rank, dict[str, TensorMeta]] = {
            (t, p): {} for t in range(self.flags.tp) for p in range(self.flags.pp)
        }
        for name, desc in self.tensors.items():
            if desc.role not in MODEL_ROLES:
                continue
            meta = TensorMeta(self.local_shape(desc), dtype_from_name(desc.dtype))
            for pp in self.pp_ranks(name):
                for tp in range(self.flags.tp):
                    out[(tp, pp)][name] = meta
        return out

    def optimizer_states(self) -> dict[str, dict[str, TensorDesc]]:
        """``{param: {key: desc}}`` of the optimizer-state tensors."""
        out: dict[str, dict[str, TensorDesc]] = {}
        for desc in self.tensors.values():
            if desc.role == "optimizer_state":
                if desc.param is None or desc.key is None:
                    raise LayoutError(
                        f"{self.path}: optimizer tensor {desc.name!r} does not name its parameter"
                    )
                out.setdefault(desc.param, {})[desc.key] = desc
        return out

    def piece_bytes(self, piece: Piece) -> int:
        """Bytes of the data ``piece`` names (a slice of a rank-local tensor for a Neuron layout, else of a whole
        tensor)."""
        desc = self.tensors.get(piece.name)
        if desc is None:
            return 0
        shape = list(self.local_shape(desc) if piece.rank is not None else desc.shape)
        if piece.dim is not None:
            shape[piece.dim] = piece.length
        return _numel(shape) * dtype_from_name(desc.dtype).itemsize

    def stored_bytes(self, piece: Piece) -> int:
        """Bytes of the whole stored tensor ``piece`` is a slice of (rank-local for a Neuron layout)."""
        desc = self.tensors.get(piece.name)
        if desc is None:
            return 0
        shape = self.local_shape(desc) if piece.rank is not None else desc.shape
        return _numel(shape) * dtype_from_name(desc.dtype).itemsize

    def read_anon(self, piece: Piece) -> int:
        """Anonymous memory :meth:`read` allocates for ``piece`` (the dry-run's estimate, :mod:`.memory`): by
        default a fresh tensor of the piece; a source that hands out views of memory-mapped files says 0."""
        return self.piece_bytes(piece)

    def cache_bytes(self, pieces: Iterable[Piece]) -> int:
        """Anonymous memory the source keeps between reads at most (its caches) while ``pieces`` are read, for the
        dry-run's estimate; none by default."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release open files."""


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def slice_of(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The part of ``t`` that ``piece`` names (a view)."""
    return t if piece.dim is None else t.narrow(piece.dim, piece.start, piece.length)


__all__ = ["LayoutKind", "MODEL_ROLES", "Rank", "Source", "slice_of"]
