"""The parallel flags an NxD tag's files do not record, detected from its tensors where they can be.

``qkv_linear`` / ``fuse_qkv`` show in the tensor names; ``kv_size_multiplier`` in the K/V shapes and ``virtual_pp``
in the layer placement over the PP ranks, both only with the model config; ``hw`` only the caller knows.  A flag the
caller gives wins over a detected one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ckpt.errors import LayoutError
from ckpt.layouts.pipeline import layer_index, layers_of_pp_rank
from ckpt.layouts.record import NxdRecord

#: flags a caller may give for a tag (the files record none of them)
SOURCE_FLAGS = ("hw", "kv_size_multiplier", "virtual_pp", "qkv_linear", "fuse_qkv")


def kv_multiplier(
    names: Sequence[str], shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any], tp: int
) -> int:
    """KV copies per head, from the stored K (or fused QKV) rows: ``kv rows * tp / head_dim / kv_heads``."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    k = next((n for n in names if n.endswith("qkv_proj.weight_k")), None)
    qkv = next((n for n in names if n.endswith("qkv_proj.weight_qkv")), None)
    if k is not None:
        kv_local = shapes[k][0]
    elif qkv is not None:
        kv_local = (shapes[qkv][0] - heads // tp * hd) // 2
    else:
        return 1
    return max(1, kv_local * tp // hd // kv_heads)


def detect_flags(
    names: Sequence[str],
    shapes: Mapping[str, tuple[int, ...]],
    config: Mapping[str, Any] | None,
    tp: int,
    given: Mapping[str, Any],
) -> dict[str, Any]:
    """The flags of the tag whose (TP rank 0) tensors are ``names`` with ``shapes``: the ``given`` ones over the
    detected ones; ``virtual_pp`` 1 here (:func:`detect_virtual_pp` finds it from the placement)."""
    detected = {
        "qkv_linear": any(".qkv_proj.weight_" in n or ".qkv_proj.bias_" in n for n in names),
        "fuse_qkv": any(
            n.endswith(("weight_qkv", "bias_qkv")) or n.endswith("qkv_proj.weight") for n in names
        ),
        "kv_size_multiplier": kv_multiplier(names, shapes, config, tp) if config else 1,
        "hw": "trn1",
        "virtual_pp": 1,
    }
    detected.update(given)
    return detected


def detect_virtual_pp(
    record: NxdRecord,
    pp_of: Mapping[str, Sequence[int]],
    config: Mapping[str, Any],
    *,
    tp: int,
    pp: int,
    dp: int,
    where: str,
) -> NxdRecord:
    """``record`` with the virtual PP degree whose layer placement matches the files (``pp_of``: the PP ranks that
    hold each tensor); NxD does not record it."""
    on = {
        p: sorted({li for n, ps in pp_of.items() if p in ps and (li := layer_index(n)) is not None})
        for p in range(pp)
    }
    for v in range(1, max(1, int(config["num_hidden_layers"]) // pp) + 1):
        candidate = dataclasses.replace(record, virtual_pp=v)
        try:
            spec = candidate.spec(tp=tp, pp=pp, dp=dp, where=where)
        except LayoutError:
            continue
        if all(list(layers_of_pp_rank(spec, p)) == on[p] for p in range(pp)):
            return candidate
    raise LayoutError(
        f"{where}: layer placement over pp ranks matches no virtual PP degree; pass --source-virtual-pp"
    )
