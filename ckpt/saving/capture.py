"""Step 1 of a save: the training objects flattened into named tensors and JSON trees (cheap, no copies).

Also the facts derived from what was captured alone: the backend the tensors live on and the default layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import data as data_mod
from ..errors import CkptError, StateMismatchError
from ..format import treecodec
from ..format.manifest import Layout
from ..state import adapters
from ..state import rng as rng_mod
from ..state import tokenizer as tokenizer_mod
from ..state.training import NamedTensor, is_dtensor, model_tensors, one_walk, state_dict_of
from .options import SaveOptions

#: ``capture_optimizer(optimizer, model)``: the optimizer's named tensors and JSON tree (an extension point of the
#: checkpointer, :meth:`ckpt.Checkpointer.capture_optimizer`)
CaptureOptimizer = Callable[[Any, Any], "tuple[list[NamedTensor], dict[str, Any]]"]


@dataclass
class Captured:
    """One rank's state as a save records it: tensors by name, the trees every rank shares (``trees``, rank 0's go
    in the manifest) and this rank's own (``rank_trees``: RNG, data loader), and, for an adapter-only save, the
    identity of the frozen base this rank holds."""

    named: list[NamedTensor]
    trees: dict[str, Any]
    rank_trees: dict[str, Any]
    base: Any = None


def check_step(step: Any) -> int:
    """A step is a non-negative integer (it names the folder ``step_%08d`` and orders checkpoints)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        try:
            ok = not isinstance(step, bool) and step.__index__() >= 0
        except (AttributeError, TypeError):
            ok = False
        if not ok:
            raise CkptError(f"step={step!r}: expected a non-negative integer")
    return int(step)


def capture(
    step: int,
    state: dict[str, Any],
    options: SaveOptions,
    capture_optimizer: CaptureOptimizer,
    base: adapters.BaseTracker,
    capture_rng: Callable[[], dict[str, Any]] = rng_mod.capture,
) -> Captured:
    """Flatten ``state`` (the training objects by keyword: ``model``, ``optimizer``, ...) as ``options`` say.

    The model's parameters are walked once for the whole capture (:func:`~ckpt.state.training.one_walk`)."""
    with one_walk(state.get("model")):
        return _capture(step, state, options, capture_optimizer, base, capture_rng)


def _capture(
    step: int,
    state: dict[str, Any],
    options: SaveOptions,
    capture_optimizer: CaptureOptimizer,
    base: adapters.BaseTracker,
    capture_rng: Callable[[], dict[str, Any]],
) -> Captured:
    model, optimizer = state.get("model"), state.get("optimizer")
    named: list[NamedTensor] = []
    trees: dict[str, Any] = {"progress": {"step": step, **(options.progress or {})}}
    ident = None
    if options.adapter_only:
        if model is None:
            raise CkptError("adapter_only=True needs model= (its trainable parameters are the adapter)")
        named.extend(model_tensors(adapters.trainable(model)))
        ident = base.identity(model, options.base_source)
    elif model is not None:
        named.extend(model_tensors(model))
    if optimizer is not None:
        opt_tensors, trees["optimizer"] = capture_optimizer(optimizer, model)
        named.extend(opt_tensors)
    for key in ("scheduler", "scaler"):
        if state.get(key) is not None:
            trees[key] = treecodec.encode(state_dict_of(state[key], key), key)
    if state.get("tokenizer") is not None:
        trees["tokenizer"] = tokenizer_mod.identity(state["tokenizer"])
    if options.metadata is not None:
        trees["user"] = treecodec.encode(options.metadata, "metadata")
    if options.extra:
        trees["extra"] = options.extra
    rank_trees: dict[str, Any] = {}
    if options.rng:
        rank_trees["rng"] = capture_rng()
    loader = state.get("dataloader")
    if loader is not None:
        rank_trees["data"] = treecodec.encode(_loader_state(loader), "dataloader")
        rank_trees["data_position"] = data_mod.position_of(loader)
    return Captured(named, trees, rank_trees, ident)


def detect_backend(tensors: list[torch.Tensor]) -> str:
    types = {t.device.type for t in tensors}
    if "xla" in types:
        return "neuron"
    if "cuda" in types:
        return "cuda"
    return "cpu"


def default_layout(named: list[NamedTensor], world: int) -> Layout:
    """Data-parallel over all ranks; for DTensor state, the device mesh it is sharded over."""
    for n in named:
        if is_dtensor(n.tensor):
            mesh = n.tensor.device_mesh
            return Layout(
                world_size=world,
                dp=world,
                mesh={"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or [])},
                kind="dtensor",
            )
    return Layout(world_size=world, dp=world, kind="replicated")


def _loader_state(loader: Any) -> Any:
    """A loader's ``state_dict``; a plain DataLoader has none, and the fix is one call (ckpt.data.track)."""
    from torch.utils.data import DataLoader

    if isinstance(loader, DataLoader) and not hasattr(loader, "state_dict"):
        raise StateMismatchError(
            "dataloader= is a plain torch DataLoader, which keeps no position: wrap it with "
            "ckpt.data.track(loader) and iterate the wrapper, or use torchdata's StatefulDataLoader"
        )
    from ..data.adapters import adapter_for, describe
    from ..data.tracked import TrackedLoader

    if isinstance(loader, TrackedLoader) and adapter_for(loader) is None:
        # A tracked loader keeps only a batch count; its position is restored through the sampler, which only an
        # adapter knows how to reposition: restoring this one would restart the epoch in a new order.
        raise StateMismatchError(
            f"dataloader= is ckpt.data.track over a loader no data adapter can reposition ({describe(loader)}): "
            "a restore would restart its epoch in a new order; use torchdata's StatefulDataLoader (it saves its "
            "RandomSampler's state) or sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=S)"
        )
    return state_dict_of(loader, "dataloader")


__all__ = ["CaptureOptimizer", "Captured", "capture", "check_step", "default_layout", "detect_backend"]
