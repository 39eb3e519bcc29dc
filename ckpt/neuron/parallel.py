"""Which tensor/pipeline/data/expert-parallel ranks this process holds.

A Neuron checkpoint must say how its shards fit together without the training code, so the saver records the
parallel sizes in the manifest and uses the ranks to place every local shard in its logical tensor.  They come
from ``neuronx_distributed.parallel_layers.parallel_state`` when NxD is importable and initialised (the source of
truth during NxD training); explicit arguments override them, and are the only source where NxD is absent.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ckpt.errors import CkptError, LayoutError

_NXD_GETTERS = {
    "tp_rank": "get_tensor_model_parallel_rank",
    "tp_size": "get_tensor_model_parallel_size",
    "pp_rank": "get_pipeline_model_parallel_rank",
    "pp_size": "get_pipeline_model_parallel_size",
    "dp_rank": "get_data_parallel_rank",
    "dp_size": "get_data_parallel_size",
    "ep_rank": "get_expert_model_parallel_rank",
    "ep_size": "get_expert_model_parallel_size",
}


@dataclass(frozen=True)
class ParallelInfo:
    """Ranks and sizes of one process. Sizes are 1 (and ranks 0) where a kind of parallelism is not used."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    def __post_init__(self) -> None:
        for kind in ("tp", "pp", "dp", "ep"):
            rank, size = getattr(self, f"{kind}_rank"), getattr(self, f"{kind}_size")
            if not isinstance(size, int) or size < 1 or not isinstance(rank, int) or not 0 <= rank < size:
                raise CkptError(f"parallel layout: {kind}_rank={rank!r} is not in [0, {kind}_size={size!r})")

    @classmethod
    def detect(cls, **explicit: int | None) -> ParallelInfo:
        """NxD's parallel state when available, with every non-None keyword (``tp_rank=``, ``dp_size=``...) winning."""
        unknown = set(explicit) - {f.name for f in fields(cls)}
        if unknown:
            raise CkptError(f"unknown parallel layout argument {sorted(unknown)[0]!r}")
        values: dict[str, Any] = from_nxd()
        values.update({k: v for k, v in explicit.items() if v is not None})
        return cls(**values)

    def check_world(self, world: int) -> None:
        """The sizes must account for every rank of the process group: ``tp * pp * dp == world`` (NxD carves expert
        parallelism out of DP), or ``tp * pp * dp * ep == world`` where DP was given without the expert ranks."""
        base = self.tp_size * self.pp_size * self.dp_size
        if world not in (base, base * self.ep_size):
            raise LayoutError(
                f"parallel sizes tp {self.tp_size} x pp {self.pp_size} x dp {self.dp_size} x ep {self.ep_size} = "
                f"{base * self.ep_size} but the process group has {world} rank{'s' if world > 1 else ''}; pass "
                f"tp_size=, pp_size=, dp_size= that multiply to {world}"
            )

    @classmethod
    def for_world(
        cls, world: int, parallel: ParallelInfo | None = None, **explicit: int | None
    ) -> ParallelInfo:
        """The layout of a process in a group of ``world`` ranks: ``parallel`` or :meth:`detect`, checked against
        ``world``.  Several ranks with neither NxD's parallel state nor explicit sizes are refused: taking them as
        tp = pp = dp = 1 would record every rank's shard as the same replicated tensor."""
        if parallel is None:
            sizes_given = any(v is not None for k, v in explicit.items() if k.endswith("_size"))
            if world > 1 and not sizes_given and not from_nxd():
                raise LayoutError(
                    f"Neuron save on {world} ranks with no NxD parallel state (neuronx_distributed is not importable "
                    "or its parallel_state is not initialised) and no parallel sizes: pass tp_size=, pp_size=, "
                    "dp_size= and the matching tp_rank=/pp_rank=/dp_rank= (or parallel=ParallelInfo(...)), or "
                    "initialise NxD's parallel_state first"
                )
            parallel = cls.detect(**explicit)
        parallel.check_world(world)
        return parallel


def from_nxd() -> dict[str, int]:
    """Ranks and sizes from ``neuronx_distributed.parallel_layers.parallel_state``; ``{}`` without (initialised) NxD."""
    try:
        from neuronx_distributed.parallel_layers import parallel_state as ps  # type: ignore[import-not-found]
    except ImportError:
        return {}
    initialised = getattr(ps, "model_parallel_is_initialized", None)
    if initialised is not None and not initialised():
        return {}
    out: dict[str, int] = {}
    for key, getter in _NXD_GETTERS.items():
        fn = getattr(ps, getter, None)
        if fn is None:  # older NxD: no expert parallelism
            continue
        out[key] = int(fn())
    return out
