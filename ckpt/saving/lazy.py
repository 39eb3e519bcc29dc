"""Step 3 of an async save: which tensors may be copied in the background, and the hooks that guard them.

A tensor is copied lazily (while training continues) only when the optimizer passed to ``save`` owns its storage
and a step pre-hook on that optimizer can hold the next ``step()`` until the copy is done; everything else is
copied before ``save`` returns (:mod:`ckpt.saving.staging` does the copies).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..state.training import is_dtensor
from ..words import count


def lazy_flags(
    tensors: list[torch.Tensor], sizes: list[int], backend: str, lazy: bool, stager: Any, optimizer: Any
) -> tuple[list[bool], str | None]:
    """Which of ``tensors`` (``sizes`` bytes each) are copied in the background, and why any are not (None when
    all are)."""
    flags = [False] * len(tensors)
    reason: str | None = None
    if not lazy:
        reason = "lazy staging off (lazy=False or a synchronous save)"
    elif getattr(stager, "begin", None) is None:
        reason = f"{type(stager).__name__} copies eagerly (it has no background begin())"
    elif backend == "neuron":
        reason = "XLA tensors: a held alias follows later in-place edits, so they are copied before returning"
    elif optimizer is None:
        reason = "no optimizer= given: no step hook can guard the saved tensors"
    elif not callable(getattr(optimizer, "register_step_pre_hook", None)):
        reason = f"optimizer {type(optimizer).__name__} has no register_step_pre_hook"
    elif not getattr(type(optimizer).step, "hooked", False):
        # torch.optim.Optimizer.__init__ wraps the class's step() so that it runs the hooks; a wrapper that
        # never called it would accept a hook and never run it
        reason = (
            f"{type(optimizer).__name__}.step() does not run step hooks (Optimizer.__init__ was not called)"
        )
    else:
        owned = _owned_storages(optimizer)
        flags = [_storage_key(t) in owned for t in tensors]
        rest = sum(s for s, f in zip(sizes, flags, strict=True) if not f)
        if rest:
            n = flags.count(False)
            reason = (
                f"{count(n, 'tensor')}, {rest} bytes, not owned by the optimizer (buffers, frozen weights)"
            )
    return flags, reason


class Guards:
    """The step pre-hooks on optimizers (and load_state_dict pre-hooks on models) that wait for lazy copies.

    Installed once per object and removed by :meth:`remove`; they hold the owner weakly, so a checkpointer that is
    gone leaves hooks that do nothing."""

    def __init__(self) -> None:
        self._hooked: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._hooked_strong: dict[int, tuple[Any, Any]] = {}

    def install(self, owner: Any, wait: Callable[[Any], None], optimizer: Any, model: Any) -> None:
        """Hook ``optimizer.step`` and ``model.load_state_dict`` to call ``wait(owner)`` first."""
        ref = weakref.ref(owner)

        def guard(*_: Any, **__: Any) -> None:
            me = ref()
            if me is not None:
                wait(me)

        for obj, register in (
            (optimizer, "register_step_pre_hook"),
            (model, "register_load_state_dict_pre_hook"),
        ):
            fn = getattr(obj, register, None)
            if fn is None:
                continue
            try:
                if obj not in self._hooked:
                    self._hooked[obj] = [fn(guard)]
            except TypeError:  # not weak-referenceable: held (strongly) until close()
                if id(obj) not in self._hooked_strong:
                    self._hooked_strong[id(obj)] = (obj, fn(guard))

    def remove(self) -> None:
        for handles in self._hooked.values():
            for h in handles:
                h.remove()
        self._hooked.clear()
        for _, h in self._hooked_strong.values():
            h.remove()
        self._hooked_strong.clear()


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    if is_dtensor(t):
        t = t._local_tensor  # type: ignore[attr-defined]
    return (t.device, t.untyped_storage().data_ptr())


def _owned_storages(optimizer: Any) -> set[tuple[torch.device, int]]:
    """Storages that only ``optimizer.step()`` mutates in a training loop: its parameters and its state tensors."""
    owned: set[tuple[torch.device, int]] = set()
    # ZeRO-1 wrappers keep the sharded master weights and moments in their base optimizer, which their own step()
    # (the hooked call) steps
    for opt in (optimizer, getattr(optimizer, "base_optimizer", None)):
        if opt is None:
            continue
        for g in getattr(opt, "param_groups", []):
            for p in g["params"]:
                owned.add(_storage_key(p))
        for per_param in getattr(opt, "state", {}).values():
            for v in per_param.values():
                if isinstance(v, torch.Tensor):
                    owned.add(_storage_key(v))
    return {k for k in owned if k[1] != 0}


__all__ = ["Guards", "lazy_flags"]
