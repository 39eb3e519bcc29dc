"""Adapter-only checkpoints: save what a fine-tune trains (LoRA matrices and their optimizer state), and name the
frozen base by identity instead of re-writing it at every save.

Which tensors are "the adapter" is decided by ``requires_grad``: the trainable parameters of the model (PEFT's
``PeftModel`` and NxD's ``LoraModel`` both freeze everything else).  Adapter-only saving is asked for explicitly,
``save(..., adapter_only=True)``, never switched on because some parameter happens to be frozen: a model with a
frozen embedding is not an adapter, and dropping its tensors silently would lose them.

The base is identified by ``manifest.adapter.base`` (docs/format.md, "Adapter checkpoints"): a content digest of
every frozen parameter (names, dtypes, shapes and bytes; xxh3-128, which runs at memory speed), the number of
tensors and bytes it covers, the model's HF config when it has one, and where the base was loaded from.  Each rank
hashes the tensors it holds; the digests of all ranks are recorded.  The digest is computed once per
:class:`BaseTracker` and reused while no frozen tensor was modified in place (``Tensor._version``), so later saves
do not re-read the base.  Restoring an adapter checkpoint into a model whose base digest differs is refused, naming
both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ..errors import BaseMismatchError, StateMismatchError
from ..words import count
from .training import named_parameters

DIGEST_ALGO = "xxh3_128"


@dataclass(frozen=True)
class BaseIdentity:
    """What identifies a frozen base model: this rank's content ``digest`` and what it covers."""

    digest: str | None
    tensors: int
    bytes: int
    config: dict[str, Any] | None = None
    source: str | None = None


def _module(model: Any) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise StateMismatchError(
            f"adapter checkpoints need model= as an nn.Module (to tell trainable from frozen), got {type(model).__name__}"
        )
    return model


def trainable(model: Any) -> dict[str, torch.Tensor]:
    """The trainable parameters by name, in ``named_parameters`` order: what an adapter checkpoint holds.

    ``named_parameters``, not ``state_dict``: NxD's ``LoraModel`` overrides ``state_dict`` (it returns the adapter
    only, gathered over TP by default, with its config inside) but not ``named_parameters``, whose names are the
    wrapped model's; for PEFT and plain modules both give the same names."""
    out = {n: p for n, p in named_parameters(_module(model)) if p.requires_grad}
    if not out:
        raise StateMismatchError(
            "adapter_only=True but the model has no trainable parameter (requires_grad=True)"
        )
    return out


def frozen(model: Any) -> dict[str, torch.Tensor]:
    """The frozen parameters (``requires_grad=False``): the base.  Buffers (rotary tables, ...) are derived from the
    config, which the identity records separately."""
    return {n: p for n, p in named_parameters(_module(model)) if not p.requires_grad}


def _config_of(model: torch.nn.Module) -> dict[str, Any] | None:
    inner = model
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        inner = get_base()
    cfg = getattr(inner, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    if not callable(to_dict):
        return None
    try:
        return json.loads(json.dumps(to_dict(), default=str))
    except (TypeError, ValueError):
        return None


def lora_config(model: Any) -> dict[str, Any] | None:
    """The adapter's own hyper-parameters, so a converter can write them out: ``{"peft": <adapter_config.json
    dict>}`` for a PEFT model (its active adapter, as ``save_pretrained`` would write it), ``{"nxd": <LoraConfig
    fields>}`` for NxD's ``LoraModel``, else None."""
    peft_cfg = getattr(model, "peft_config", None)
    if isinstance(peft_cfg, dict) and peft_cfg:
        name = getattr(model, "active_adapter", None)
        cfg = peft_cfg.get(name if isinstance(name, str) else next(iter(peft_cfg)))
        to_dict = getattr(cfg, "to_dict", None)
        if callable(to_dict):
            d = {k: sorted(v) if isinstance(v, set) else v for k, v in to_dict().items()}
            d["inference_mode"] = True  # what PeftModel.save_pretrained writes
            return {"peft": json.loads(json.dumps(d, default=str))}
    nxd_cfg = getattr(model, "lora_config", None)
    if nxd_cfg is not None and hasattr(nxd_cfg, "lora_rank"):
        import dataclasses

        if dataclasses.is_dataclass(nxd_cfg):
            return {"nxd": json.loads(json.dumps(dataclasses.asdict(nxd_cfg), default=str))}
    return None


def _source_of(model: torch.nn.Module, config: dict[str, Any] | None) -> str | None:
    if config and config.get("_name_or_path"):
        return str(config["_name_or_path"])
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.detach().cpu().contiguous()


def base_identity(model: Any, *, source: str | None = None) -> BaseIdentity:
    """Identity of the frozen part of ``model`` on this rank (reads every frozen byte once)."""
    m = _module(model)
    h = xxhash.xxh3_128()
    n = nbytes = 0
    for name, t in sorted(frozen(m).items()):
        local = _local(t)
        h.update(f"{name}\0{local.dtype}\0{list(local.shape)}\0".encode())
        if local.numel():
            h.update(local.reshape(-1).view(torch.uint8).numpy().tobytes())
        n += 1
        nbytes += local.numel() * local.element_size()
    config = _config_of(m)
    return BaseIdentity(f"{DIGEST_ALGO}:{h.hexdigest()}", n, nbytes, config, source or _source_of(m, config))


class BaseTracker:
    """Caches :func:`base_identity` while the frozen tensors are the same objects, unmodified in place."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._identity: BaseIdentity | None = None

    def identity(self, model: Any, source: str | None = None) -> BaseIdentity:
        key = tuple((n, id(t), t._version) for n, t in frozen(model).items()) + (source,)
        if key != self._key or self._identity is None:
            self._identity = base_identity(model, source=source)
            self._key = key
        return self._identity


def manifest_record(per_rank: list[BaseIdentity], lora: dict[str, Any] | None = None) -> dict[str, Any]:
    """``manifest.adapter``: the base's identity as every rank saw it (rank 0's config and source), and the
    adapter's own config (:func:`lora_config`) when known."""
    first = per_rank[0]
    if first.digest is None:  # a converted adapter: its base is not known (docs/format.md)
        return {
            "lora": lora,
            "base": {
                "digest": None,
                "tensors": 0,
                "bytes": 0,
                "config": first.config,
                "source": first.source,
            },
        }
    return {
        "lora": lora,
        "base": {
            "digest": first.digest,
            "rank_digests": [b.digest for b in per_rank],
            "tensors": sum(b.tensors for b in per_rank),
            "bytes": sum(b.bytes for b in per_rank),
            "config": first.config,
            "source": first.source,
        },
    }


def check_base(record: dict[str, Any], live: BaseIdentity, rank: int, world: int, where: str) -> None:
    """Refuse to restore an adapter onto a base other than the one it was trained on (one line naming both)."""
    base = record.get("base") or {}
    digests = base.get("rank_digests") or [base.get("digest")]
    if len(digests) == world:
        want = digests[rank]
    elif len(set(digests)) == 1:
        want = digests[0]  # a replicated base: every rank holds the same tensors
    else:
        raise StateMismatchError(
            f"{where}: the adapter's base was recorded for {count(len(digests), 'rank')} holding different shards; restore "
            f"on {count(len(digests), 'rank')} (now {world}) or pass check_base=False"
        )
    if want is None:  # converted from a format that does not identify the base (NxD LoRA tag, PEFT folder)
        import warnings

        warnings.warn(
            f"{where}: the adapter's base is not recorded (converted from an NxD LoRA tag or PEFT folder); the "
            "model's base was not checked",
            stacklevel=3,
        )
        return
    if live.digest != want:
        saved_src = base.get("source") or "unknown source"
        live_src = live.source or "unknown source"
        raise BaseMismatchError(
            f"{where}: adapter was trained on base {saved_src} ({want}), the model's base is {live_src} "
            f"({live.digest}) on rank {rank}; load the base it was trained on (or pass check_base=False)"
        )


__all__ = [
    "BaseIdentity",
    "BaseTracker",
    "DIGEST_ALGO",
    "base_identity",
    "check_base",
    "frozen",
    "lora_config",
    "manifest_record",
    "trainable",
]
