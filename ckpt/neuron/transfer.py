"""Moving many tensors between the XLA device and the host in one runtime call each way.

One ``.cpu()`` per tensor is one device->host transfer (and one graph sync) per tensor: on Trainium that is
thousands of round trips for a 7B model.  ``torch_xla._XLAC._xla_get_cpu_tensors`` takes a list and fetches all
of it in one transfer (verified with torch_xla 2.9's ``TransferFromDeviceTime`` metric: one sample per call,
whatever the list length); ``_xla_tensors_from_aten`` uploads a list of host tensors in one call.  torch_xla is
imported lazily so that nothing here runs on machines without it unless an XLA tensor is actually present.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def is_xla(t: torch.Tensor) -> bool:
    return t.device.type == "xla"


def sync() -> None:
    """Execute the pending lazy graph (``torch_xla.sync()``; ``xm.mark_step()`` on older torch_xla)."""
    import torch_xla

    if hasattr(torch_xla, "sync"):
        torch_xla.sync()
    else:  # pragma: no cover - torch_xla < 2.6
        import torch_xla.core.xla_model as xm

        xm.mark_step()


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors``: all XLA ones in one batched transfer, the others cloned (never aliased)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    xla_idx = [i for i, t in enumerate(tensors) if is_xla(t)]
    if xla_idx:
        import torch_xla

        fetched = torch_xla._XLAC._xla_get_cpu_tensors([tensors[i].detach() for i in xla_idx])
        for i, t in zip(xla_idx, fetched, strict=True):
            out[i] = t
    for i, t in enumerate(tensors):
        if out[i] is None:
            out[i] = t.detach().to("cpu", copy=True)
    return [t if t.is_contiguous() else t.contiguous() for t in out]  # type: ignore[union-attr]


def to_device(tensors: Sequence[torch.Tensor], device: Any) -> list[torch.Tensor]:
    """``tensors`` (host) on ``device``: one batched upload when it is an XLA device, else ``.to`` each."""
    if not tensors:
        return []
    dev = torch.device(device)
    if dev.type != "xla":
        return [t.to(dev) for t in tensors]
    import torch_xla

    host = [t.contiguous() for t in tensors]
    return list(torch_xla._XLAC._xla_tensors_from_aten(host, [str(dev)] * len(host), None))
