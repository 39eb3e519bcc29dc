"""LoRA adapter tensors in NxD's parallel layout (``neuronx_distributed.modules.lora``, NxD 0.18).

An adapter of target module ``M`` (HF name, e.g. ``model.layers.0.self_attn.q_proj``) is two matrices,
``M.lora_A.weight`` ``(r, in)`` and ``M.lora_B.weight`` ``(out, r)``; the layer computes ``W x + s * B (A x)``.
How NxD shards them follows from which parallel layer wraps ``M`` (facts from ``modules/lora/tp_layer.py``):

==============================  ====================================================================
base layer of ``M``             adapter on each TP rank
==============================  ====================================================================
``ColumnParallelLinear``        ``lora_A`` is a plain ``nn.Linear``: whole on every rank; ``lora_B`` is a
(q/k/v, gate/up)                ``ColumnParallelLinear``: its rows split like the base weight's rows
``RowParallelLinear``           ``lora_A`` is a ``RowParallelLinear``: its columns split like the base weight's
(o_proj, down_proj)             columns; ``lora_B`` is a plain ``nn.Linear``: whole on every rank
``GQAQKVColumnParallelLinear``  ONE ``lora_A`` (whole) shared by q, k and v; ``lora_B`` is itself a
(``qkv_linear``)                ``GQAQKVColumnParallelLinear`` (``weight_q|k|v`` or ``weight_qkv``) with the
                                base's ``kv_size_multiplier``: rows follow the GQA head layout of the base
==============================  ====================================================================

A base that NxD fuses into one layer (``gate_up_proj``; ``qkv_proj`` with ``qkv_linear`` or ``fuse_qkv``) gets one
LoRA layer, so its parts share one ``lora_A``.  On each rank the ``lora_B`` shard is what makes the rank's output
right: rows in the same order as the base weight's rows on that rank (``cat[B_gate_r, B_up_r]`` for
``gate_up_proj``).  Hence every LoRA placement below is derived from the base weight's placement
(:func:`ckpt.layouts.plan.placements`), so base and adapter can never disagree.

A PEFT adapter whose fused parts have different ``lora_A`` (every adapter PEFT trains) cannot be held by NxD's
shared-A layer as it is: :mod:`converters.lora_widen` first widens it to an exact equivalent that can (stacked
``lora_A``, block-diagonal ``lora_B``); given such parts directly, :func:`adapter_to_nxd` refuses them.
Names matched by no rule here are refused, never replicated by default.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ckpt.errors import LayoutError
from ckpt.layouts.execute import bit_equal
from ckpt.layouts.names import hf_to_nxd_name, nxd_to_hf_names
from ckpt.layouts.pipeline import pp_ranks_of
from ckpt.layouts.plan import Placement, Rank, expected_full_shape, placements, rank_tensor_pairs
from ckpt.layouts.spec import LayoutSpec

#: HF (PEFT, prefix removed) adapter tensor name: ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``
HF_LORA = re.compile(r"^(?P<mod>.+)\.lora_(?P<ab>[AB])\.weight$")
#: NxD adapter tensor name: ``<module>.lora_A.weight`` or ``<module>.lora_B.<leaf>`` (``weight_q``, ``weight_qkv``..)
NXD_LORA = re.compile(r"^(?P<mod>.+)\.lora_(?P<ab>[AB])\.(?P<leaf>weight(_q|_k|_v|_qkv)?)$")


@dataclass(frozen=True)
class LoraRule:
    """Which target modules may carry a LoRA adapter, and what parallel layer NxD wraps them in."""

    pattern: str
    parallel: str  # "column" | "row"


#: Every target module ckpt knows the NxD layout of (Llama/Mistral/Qwen2 decoders); first match wins.
LORA_RULES: tuple[LoraRule, ...] = (
    LoraRule(r"^model\.layers\.\d+\.self_attn\.[qkv]_proj$", "column"),
    LoraRule(r"^model\.layers\.\d+\.self_attn\.o_proj$", "row"),
    LoraRule(r"^model\.layers\.\d+\.mlp\.(gate|up)_proj$", "column"),
    LoraRule(r"^model\.layers\.\d+\.mlp\.down_proj$", "row"),
)


def lora_rule(module: str) -> LoraRule:
    """The rule of target module ``module`` (HF name); ``LayoutError`` when none matches."""
    for r in LORA_RULES:
        if re.search(r.pattern, module):
            return r
    raise LayoutError(
        f"{module}: no LoRA layout rule for this target module (known: q/k/v/o_proj, gate/up/down_proj of "
        "model.layers.N); its NxD sharding is unknown, refusing to guess"
    )


def parse_hf(name: str) -> tuple[str, str]:
    """``(module, "A"|"B")`` of an HF adapter tensor name; ``LayoutError`` for anything else (biases, DoRA
    magnitudes, embedding adapters)."""
    m = HF_LORA.match(name)
    if m is None:
        raise LayoutError(
            f"{name}: not a LoRA matrix (<module>.lora_A.weight / lora_B.weight); ckpt converts plain LoRA "
            "adapters only (no lora bias, DoRA magnitude or embedding adapters)"
        )
    lora_rule(m["mod"])
    return m["mod"], m["ab"]


def _split_leaf(nxd_base: str) -> tuple[str, str]:
    mod, _, leaf = nxd_base.rpartition(".")
    return mod, leaf


def nxd_lora_name(hf_name: str, spec: LayoutSpec) -> str:
    """NxD name of the tensor HF adapter tensor ``hf_name`` is stored in (shared ``lora_A`` names coincide)."""
    mod, ab = parse_hf(hf_name)
    nxd_mod, leaf = _split_leaf(hf_to_nxd_name(f"{mod}.weight", spec))
    if ab == "A" or lora_rule(mod).parallel == "row":
        return f"{nxd_mod}.lora_{ab}.weight"
    return f"{nxd_mod}.lora_B.{leaf}"


def hf_lora_names(nxd_name: str) -> tuple[str, ...]:
    """HF adapter tensors held by NxD adapter tensor ``nxd_name`` (one per fused part; ``lora_A`` of a fused
    layer is one shared tensor standing for each part's ``lora_A``)."""
    m = NXD_LORA.match(nxd_name)
    if m is None:
        raise LayoutError(
            f"{nxd_name}: not an NxD LoRA tensor name (<module>.lora_A.weight / lora_B.weight[_q|_k|_v|_qkv])"
        )
    leaf = "weight" if m["ab"] == "A" else m["leaf"]
    if m["ab"] == "A" and m["mod"].endswith(".qkv_proj"):
        # qkv_linear spells the base leaf weight_q|k|v; lora_A is shared by all three
        bases = tuple(b for p in "qkv" for b in nxd_to_hf_names(f"{m['mod']}.weight_{p}"))
    else:
        bases = nxd_to_hf_names(f"{m['mod']}.{leaf}")
    out = tuple(f"{b.removesuffix('.weight')}.lora_{m['ab']}.weight" for b in bases)
    for name in out:
        parse_hf(name)
    return out


def _base_shape(module: str, spec: LayoutSpec) -> tuple[int, int]:
    base = f"{module}.weight"
    shape = expected_full_shape(base, spec, ())
    assert shape is not None and len(shape) == 2, base
    return shape  # type: ignore[return-value]


def expected_shape(hf_name: str, spec: LayoutSpec, rank: int) -> tuple[int, int]:
    """Full shape of HF adapter tensor ``hf_name`` for LoRA rank ``rank`` under the model config."""
    mod, ab = parse_hf(hf_name)
    out, inp = _base_shape(mod, spec)
    return (rank, inp) if ab == "A" else (out, rank)


def lora_placements(spec: LayoutSpec, hf_name: str, shape: tuple[int, ...]) -> tuple[Placement, ...]:
    """Where every piece of HF adapter tensor ``hf_name`` (full ``shape``) lives in NxD's LoRA layout."""
    mod, ab = parse_hf(hf_name)
    shape = tuple(shape)
    if len(shape) != 2:
        raise LayoutError(f"{hf_name} has shape {list(shape)}; a LoRA matrix is 2-D")
    r = shape[0] if ab == "A" else shape[1]
    want = expected_shape(hf_name, spec, r)
    if shape != want:
        raise LayoutError(f"{hf_name} has shape {list(shape)} but the config implies {list(want)} (rank {r})")
    nxd = nxd_lora_name(hf_name, spec)
    base = f"{mod}.weight"
    split = (ab == "B") == (lora_rule(mod).parallel == "column")
    if split:
        # the split matrix follows the base weight's rows (lora_B, column) or columns (lora_A, row) exactly
        return tuple(
            Placement(hf_name, p.rank, nxd, p.dim, p.hf_start, p.nxd_start, p.length, p.replica)
            for p in placements(spec, base, _base_shape(mod, spec))
        )
    out = []
    for i, pp in enumerate(pp_ranks_of(base, spec)):
        for tp in range(spec.tp):
            out.append(Placement(hf_name, (tp, pp), nxd, None, 0, 0, 0, i * spec.tp + tp))
    return tuple(out)


def _lora_rank(adapter: Mapping[str, torch.Tensor]) -> int:
    ranks = {}
    for name, t in adapter.items():
        _, ab = parse_hf(name)
        ranks[name] = t.shape[0] if ab == "A" else t.shape[-1]
    if len(set(ranks.values())) > 1:
        lo = min(ranks, key=lambda n: ranks[n])
        hi = max(ranks, key=lambda n: ranks[n])
        raise LayoutError(
            f"LoRA ranks differ: {lo} has rank {ranks[lo]}, {hi} has rank {ranks[hi]}; NxD's LoraConfig has one "
            "lora_rank for every module"
        )
    return next(iter(ranks.values()), 0)


def adapter_to_nxd(
    adapter: Mapping[str, torch.Tensor], spec: LayoutSpec
) -> dict[Rank, dict[str, torch.Tensor]]:
    """HF-named adapter tensors -> ``{(tp, pp): {nxd_name: tensor}}`` in NxD's LoRA layout (fresh tensors).

    Raises ``LayoutError`` for unknown names, shapes the config contradicts, a fused layer whose parts are not all
    adapted, or parts of a shared-``lora_A`` layer whose ``lora_A`` differ (not representable; nothing is
    approximated).
    """
    _lora_rank(adapter)
    grouped: dict[tuple[Rank, str], list[Placement]] = {}
    for name, t in adapter.items():
        for p in lora_placements(spec, name, tuple(t.shape)):
            grouped.setdefault((p.rank, p.nxd_name), []).append(p)
    _check_shared(adapter, spec)
    out: dict[Rank, dict[str, torch.Tensor]] = {}
    for (rank, nxd), ps in grouped.items():
        parts = hf_lora_names(nxd)
        missing = [h for h in parts if h not in adapter]
        if missing:
            raise LayoutError(
                f"{nxd}: NxD fuses {', '.join(parts)} into one LoRA layer but {', '.join(missing)} is not in the "
                "adapter (ckpt convert adds a zero part first: converters/lora_widen.py)"
            )
        if ps[0].dim is None:
            out.setdefault(rank, {})[nxd] = adapter[parts[0]].detach().clone()
            continue
        ps = sorted(ps, key=lambda p: p.nxd_start)
        pieces = [adapter[p.hf_name].narrow(p.dim, p.hf_start, p.length) for p in ps]
        out.setdefault(rank, {})[nxd] = torch.cat(pieces, dim=ps[0].dim)
    return {rk: out[rk] for rk in spec.ranks if rk in out}


def _check_shared(adapter: Mapping[str, torch.Tensor], spec: LayoutSpec) -> None:
    """Parts of one NxD LoRA layer (q/k/v of ``qkv_proj``, gate/up of ``gate_up_proj``) must have one lora_A."""
    shared = {nxd_lora_name(n, spec) for n in adapter if parse_hf(n)[1] == "A"}
    for nxd in sorted(shared):
        parts = [h for h in hf_lora_names(nxd) if h in adapter]
        for name in parts[1:]:
            if bit_equal(adapter[parts[0]], adapter[name]):
                continue
            raise LayoutError(
                f"{name} differs from {parts[0]}: NxD's LoRA layer {nxd} shares one lora_A between them, so these "
                "tensors cannot be laid out as they are (ckpt convert widens such adapters first: "
                "converters/lora_widen.py)"
            )


def nxd_to_adapter(
    shards: Mapping[Rank, Mapping[str, torch.Tensor]], spec: LayoutSpec
) -> dict[str, torch.Tensor]:
    """``{(tp, pp): {nxd_name: tensor}}`` in NxD's LoRA layout -> HF-named adapter tensors.

    Every rank must hold exactly what the layout implies, and every stored copy (replicated ``lora_A``/``lora_B``,
    KV replicas) must be bit-identical to the canonical one; otherwise ``LayoutError`` names the tensor and rank.
    """
    for rank in shards:
        if rank not in spec.ranks:
            raise LayoutError(
                f"LoRA tensors on tp rank {rank[0]}, pp rank {rank[1]} outside --tp {spec.tp} --pp {spec.pp}"
            )
    names: dict[str, int] = {}
    for sd in shards.values():
        for nxd, t in sd.items():
            m = NXD_LORA.match(nxd)
            for hf in hf_lora_names(nxd):
                if hf not in names:
                    names[hf] = t.shape[0] if (m and m["ab"] == "A") else t.shape[-1]
    out: dict[str, torch.Tensor] = {}
    for hf, r in names.items():
        shape = expected_shape(hf, spec, r)
        ps = lora_placements(spec, hf, shape)
        by_replica: dict[int, list[Placement]] = {}
        for p in ps:
            by_replica.setdefault(p.replica, []).append(p)
        copies = []
        for _, group in sorted(by_replica.items()):
            group = sorted(group, key=lambda p: p.hf_start)
            pieces = []
            for p in group:
                local = shards.get(p.rank, {}).get(p.nxd_name)
                where = f"tp rank {p.rank[0]}, pp rank {p.rank[1]}"
                if local is None:
                    raise LayoutError(
                        f"{p.nxd_name} (LoRA of {hf}) is missing on {where} (check --tp/--pp/--qkv-linear)"
                    )
                pieces.append(local if p.dim is None else local.narrow(p.dim, p.nxd_start, p.length))
            copies.append(
                (group, pieces[0].clone() if group[0].dim is None else torch.cat(pieces, group[0].dim))
            )
        canonical = copies[0][1]
        if tuple(canonical.shape) != shape:
            raise LayoutError(
                f"{hf}: NxD shards assemble to {list(canonical.shape)}, the config implies {list(shape)} "
                "(check --tp / --kv-size-multiplier / --qkv-linear)"
            )
        for group, t in copies[1:]:
            if not bit_equal(canonical, t):
                where = sorted({p.rank for p in group})
                raise LayoutError(
                    f"{hf}: the copy stored on (tp, pp) {where} differs from the one on rank {copies[0][0][0].rank} "
                    "(check --hw / --kv-size-multiplier)"
                )
        out[hf] = canonical
    _check_rank_sizes(shards, spec, out)
    _lora_rank(out)
    return out


def _check_rank_sizes(
    shards: Mapping[Rank, Mapping[str, torch.Tensor]], spec: LayoutSpec, adapter: Mapping[str, torch.Tensor]
) -> None:
    """Every rank tensor must be exactly what the adapter lays out to (no extra rows, names or ranks)."""
    want = adapter_to_nxd(adapter, spec)
    for where, name, have, t in rank_tensor_pairs(
        spec.ranks,
        lambda rank: shards.get(rank, {}),
        lambda rank: want.get(rank, {}),
        "check --pp / --qkv-linear",
        "check --pp / --qkv-linear / --fuse-qkv",
    ):
        if tuple(have.shape) != tuple(t.shape) or have.dtype != t.dtype:
            raise LayoutError(
                f"{name} on {where} is {list(have.shape)} {have.dtype}, this layout expects "
                f"{list(t.shape)} {t.dtype} (check --tp / --kv-size-multiplier)"
            )
        if not bit_equal(have, t):
            raise LayoutError(
                f"{name} on {where} holds values no HF adapter lays out to (shared lora_A copies differ?)"
            )


def is_lora_name(name: str) -> bool:
    """True for names of LoRA matrices (HF/PEFT or NxD spelling)."""
    return ".lora_A." in name or ".lora_B." in name


__all__ = [
    "HF_LORA",
    "LORA_RULES",
    "NXD_LORA",
    "LoraRule",
    "adapter_to_nxd",
    "expected_shape",
    "hf_lora_names",
    "is_lora_name",
    "lora_placements",
    "lora_rule",
    "nxd_lora_name",
    "nxd_to_adapter",
    "parse_hf",
]
