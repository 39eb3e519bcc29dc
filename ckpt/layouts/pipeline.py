"""Pipeline-parallel placement: which PP rank holds each tensor.

Facts from NxD 0.18 (``pipeline/partition.py`` ``create_partitions`` / ``stage_to_pipeline_parallel_rank``
and ``scripts/checkpoint_converter.py``):

* decoder layers are split evenly over ``pp * virtual_pp`` stages; the remainder goes one extra layer each
  to the *last* stages;
* stage ``s`` runs on PP rank ``s % pp`` (so with virtual PP a rank holds several non-adjacent blocks);
* layer names keep their global index (``model.layers.5`` stays ``model.layers.5`` on its rank);
* ``embed_tokens`` lives on PP rank 0, ``model.norm`` and ``lm_head`` on the last PP rank (the patterns are the
  family's ``first_stage`` / ``last_stage``); any other non-layer tensor (e.g. a ``rotary_emb.inv_freq`` buffer) is
  kept on every PP rank.
"""

from __future__ import annotations

import re

from ckpt.errors import LayoutError
from ckpt.layouts.spec import LayoutSpec

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def stage_layer_counts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage: even split, remainder on the later stages."""
    if num_stages < 1 or num_layers < num_stages:
        raise LayoutError(f"{num_stages} pipeline stages need at least as many layers, got {num_layers}")
    base, rem = divmod(num_layers, num_stages)
    return tuple(base + (1 if s >= num_stages - rem else 0) for s in range(num_stages))


def layer_stage(layer: int, num_layers: int, num_stages: int) -> int:
    """Stage index of global layer ``layer``."""
    if not 0 <= layer < num_layers:
        raise LayoutError(f"layer index {layer} is outside num_hidden_layers={num_layers}")
    end = 0
    for stage, count in enumerate(stage_layer_counts(num_layers, num_stages)):
        end += count
        if layer < end:
            return stage
    raise AssertionError("unreachable")


def layer_pp_rank(layer: int, spec: LayoutSpec) -> int:
    """PP rank holding global layer ``layer``."""
    return layer_stage(layer, spec.model.layers, spec.num_stages) % spec.pp


def layers_of_pp_rank(spec: LayoutSpec, pp_rank: int) -> tuple[int, ...]:
    """Global layer indices held by ``pp_rank``, ascending."""
    return tuple(i for i in range(spec.model.layers) if layer_pp_rank(i, spec) == pp_rank)


def layer_index(name: str) -> int | None:
    """Global layer index of a ``model.layers.N.*`` name, else ``None``."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def pp_ranks_of(name: str, spec: LayoutSpec) -> tuple[int, ...]:
    """PP ranks that store tensor ``name`` (same answer for HF and NxD names)."""
    layer = layer_index(name)
    if layer is not None:
        return (layer_pp_rank(layer, spec),)
    family = spec.family
    if re.search(family.first_stage, name):
        return (0,)
    if re.search(family.last_stage, name):
        return (spec.pp - 1,)
    return tuple(range(spec.pp))
