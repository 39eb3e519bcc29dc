"""SHIM: torch_xla's cross-process collectives and rank queries, answered by the torch.distributed gloo group.

On Trainium every process drives one NeuronCore and torch_xla's collectives (``xm.all_reduce``, ``xm.reduce_scatter``,
``xm.all_gather`` over replica groups of global ranks) run on the device.  On a CPU machine torch_xla's PJRT CPU client
gives each process one XLA CPU device and no collectives across processes, and its rank queries answer 0 of 1.  This
module replaces exactly those pieces of torch_xla (not of NxD), in each rank process, before NxD is imported:

* ``xr.global_ordinal`` / ``xr.global_device_count`` / ``xr.world_size`` / ``xr.local_ordinal`` /
  ``xm.get_ordinal`` / ``xm.xrt_world_size``: the torch.distributed rank and world size;
* ``xm.all_reduce`` / ``xm.reduce_scatter`` / ``xm.all_gather`` (what ``ZeroRedundancyOptimizer`` and NxD's gradient
  norm call with ``groups=[[global ranks], ...]``): host copies of the XLA tensors reduced/gathered over the gloo
  group holding this rank, the result put back on the XLA device (same arithmetic: sum, then ``scale``);
* ``xm.rendezvous``: ``torch.distributed.barrier``;
* ``xenv.HOST_WORLD_SIZE`` (a name torch_xla 2.9 dropped, read by NxD's ``get_local_world_size`` off Neuron): one host;
* ``torch.distributed`` collectives called by NxD's CPU-mode code (``NXD_CPU_MODE=1``: ``all_reduce``, ``all_gather``,
  ``all_gather_into_tensor``, ``reduce``, ``scatter``, ``broadcast``) on XLA tensors: the call runs on host copies and
  every XLA tensor argument is written back (gloo cannot read XLA tensors); a ``group=`` given as a list of
  replica groups (what NxD's CPU-mode ``comm.all_reduce`` passes on from ``NeuronZero1Optimizer``'s gradient norm,
  whose ``zero1_optimizer_groups`` are XLA replica groups) becomes the gloo group holding this rank; an
  ``async_op=True`` call (NxD's column-parallel backward) completes before returning a finished handle.

Everything else (the XLA device, lazy tensors, graph execution, ZeroRedundancyOptimizer's sharding and state dict,
NxD's layers, optimizer, save and converter) runs as shipped.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.distributed as dist

_GROUPS: dict[tuple[tuple[int, ...], ...], Any] = {}
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "mul": dist.ReduceOp.PRODUCT,
}


def _group(groups: Any) -> Any:
    """The gloo group holding this rank among ``groups`` (lists of global ranks); None: the world."""
    if not groups:
        return None
    key = tuple(tuple(int(r) for r in g) for g in groups)
    if key not in _GROUPS:  # every rank builds every group of the list, in the same order (gloo needs that)
        made = [dist.new_group(list(g), backend="gloo") for g in key]
        rank = dist.get_rank()
        _GROUPS[key] = next(pg for g, pg in zip(key, made, strict=True) if rank in g)
    return _GROUPS[key]


def _materialize() -> None:
    """Run every pending XLA computation as one graph before a host copy (copying one lazy tensor would compile a
    graph just for it, and the next one another graph recomputing the shared part)."""
    import torch_xla

    torch_xla.sync()


def _xla(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "xla"


def all_reduce(
    reduce_type: str, inputs: Any, scale: float = 1.0, groups: Any = None, pin_layout: bool = True
) -> Any:
    single = isinstance(inputs, torch.Tensor)
    _materialize()
    out = []
    for t in [inputs] if single else inputs:
        host = t.detach().cpu().clone()
        dist.all_reduce(host, op=_OPS[reduce_type], group=_group(groups))
        if scale != 1.0:
            host.mul_(scale)
        res = host.to(t.device)
        if not single:
            t.copy_(res)
        out.append(res)
    return out[0] if single else inputs


def reduce_scatter(
    reduce_type: str, input: Any, scale: float, scatter_dim: int, shard_count: int, groups: Any = None,
    output: Any = None, pin_layout: bool = True, **_: Any,
) -> Any:  # fmt: skip
    group = _group(groups)
    _materialize()
    host = input.detach().cpu().clone()
    dist.all_reduce(host, op=_OPS[reduce_type], group=group)
    rank = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
    shard = host.chunk(shard_count, dim=scatter_dim)[rank].contiguous()
    if scale != 1.0:
        shard.mul_(scale)
    res = shard.to(input.device)
    if output is not None:
        output.copy_(res)
        return output
    return res


def all_gather(
    value: Any, dim: int = 0, groups: Any = None, output: Any = None, pin_layout: bool = True, **_: Any
) -> Any:
    group = _group(groups)
    _materialize()
    host = value.detach().cpu().contiguous()
    parts = [torch.empty_like(host) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, host, group=group)
    res = torch.cat(parts, dim=dim).to(value.device)
    if output is not None:
        output.copy_(res)
        return output
    return res


def rendezvous(tag: str, payload: bytes = b"", replicas: Any = ()) -> list[bytes]:
    dist.barrier()
    return [payload]


class _Done:
    """The work handle of an ``async_op=True`` call, which already completed (NxD waits on it)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _on_host(fn: Any) -> Any:
    """``fn`` (a torch.distributed collective) on host copies of its XLA tensor arguments, written back after."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        back: list[tuple[torch.Tensor, torch.Tensor]] = []

        if any(
            _xla(v) or (isinstance(v, list) and any(_xla(x) for x in v)) for v in (*args, *kwargs.values())
        ):
            _materialize()

        def host(v: Any) -> Any:
            if _xla(v):
                h = v.detach().cpu().clone()
                back.append((v, h))
                return h
            if isinstance(v, list) and any(_xla(x) for x in v):
                return [host(x) for x in v]
            return v

        args = tuple(host(a) for a in args)
        kwargs = {k: host(v) for k, v in kwargs.items()}
        if isinstance(kwargs.get("group"), list):  # an XLA replica-group list (NxD CPU mode passes ZeRO-1's)
            kwargs["group"] = _group(kwargs["group"])
        if not back:
            return fn(*args, **kwargs)
        asked_async = bool(
            kwargs.pop("async_op", False)
        )  # the copy back needs the result: run it to completion
        fn(*args, **kwargs)
        with torch.no_grad():
            for dev, h in back:
                dev.copy_(h.to(dev.device))
        return _Done() if asked_async else None

    return wrapper


def install() -> None:
    """Patch torch_xla and torch.distributed as described above (idempotent; call after init_process_group)."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    if getattr(xm, "_nxd_shim_gloo", False):
        return
    rank, world = dist.get_rank, dist.get_world_size
    for mod, name, fn in (
        (xr, "global_ordinal", rank), (xr, "global_device_count", world), (xr, "world_size", world),
        (xr, "local_ordinal", rank), (xm, "get_ordinal", lambda *a, **k: rank()),
        (xm, "xrt_world_size", lambda *a, **k: world()), (xm, "all_reduce", all_reduce),
        (xm, "reduce_scatter", reduce_scatter), (xm, "all_gather", all_gather), (xm, "rendezvous", rendezvous),
    ):  # fmt: skip
        setattr(mod, name, fn)
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce", "scatter", "broadcast"):
        setattr(dist, name, _on_host(getattr(dist, name)))
    import torch_xla.core.xla_env_vars as xenv

    # NxD's get_local_world_size (parallel_layers/utils.py) reads os.environ[xenv.HOST_WORLD_SIZE] unless PJRT_DEVICE is
    # NEURON; torch_xla 2.9 no longer defines that name.  One host: every rank is local.
    if not hasattr(xenv, "HOST_WORLD_SIZE"):
        xenv.HOST_WORLD_SIZE = "XRT_HOST_WORLD_SIZE"
    os.environ.setdefault(xenv.HOST_WORLD_SIZE, "1")
    xm._nxd_shim_gloo = True
