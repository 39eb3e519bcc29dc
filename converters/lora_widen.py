"""Widening: PEFT adapters with an independent ``lora_A`` per module, held exactly by NxD's fused LoRA layers.

NxD fuses some HF modules into one layer with ONE ``lora_A`` (gate/up into ``gate_up_proj`` always; q/k/v into
``qkv_proj`` with ``--qkv-linear``/``--fuse-qkv``), and its ``LoraConfig`` has one ``lora_rank``/``lora_alpha`` for
every layer.  A PEFT adapter (``LoraConfig(target_modules="all-linear")``) has its own ``A_m`` (``r_m`` rows) per
module, and with ``rank_pattern``/``alpha_pattern`` its own rank and alpha.  Exact form on the fused layer of parts
``m1..mk``: ``lora_A = [A_m1; ...; A_mk; 0]`` (rank ``R``: the largest fused sum over the model), each part's
``lora_B`` rows ``[0 .. B_m .. 0]`` (its block at its offset, zeros elsewhere), and every unfused layer padded to
``R`` with zero rows of ``A`` and zero columns of ``B``.  Each part's output is then ``s * B_m A_m x`` plus exact
zeros, PEFT's sum.  The scaling ``s`` must be the same for every module (NxD has one), and NxD's ``lora_alpha`` is
chosen so that ``lora_alpha / R`` (``/ sqrt(R)`` with rsLoRA) is ``s`` to the last bit: nothing is rescaled, so the
way back is slicing.  Differing scalings are refused.  A fused part the adapter lacks (PEFT's default q/v with
``--qkv-linear``: no k) gets a zero ``lora_B`` block of no rows of ``A`` (rank 0 in the record).

The record (``RECORD_KEY`` in the tag's ``adapter_config.json``) names each HF module's rank, alpha, offset and NxD
layer.  Back (:func:`narrow`), per module: if the columns of its ``lora_B`` outside its block are all zero (with the
optimizer's moments there), it returns as it was, bit for bit; once training on Trainium has filled them (they do
train: the off-diagonal blocks get gradients), it returns with the wider rank: the layer's shared ``lora_A`` rows
and its own ``lora_B`` rows over the columns in use (trailing all-zero pad columns dropped, which is exact), the
alpha giving the same scaling, spelled in ``rank_pattern``/``alpha_pattern``.

The interface is :func:`widen` / :func:`narrow` on :class:`converters.peft.Adapter` (HF names), so any reader of
PEFT-shaped adapters can call it before laying an adapter out for NxD.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ckpt.errors import LayoutError
from ckpt.layouts.execute import bit_equal
from ckpt.layouts.lora import expected_shape, hf_lora_names, nxd_lora_name, parse_hf
from ckpt.layouts.spec import LayoutSpec

from .peft import Adapter, pattern_key

#: key of the widening record in the tag's adapter_config.json (NxD's loader reads only its own fields from it)
RECORD_KEY = "ckpt_widened"


def _a(mod: str) -> str:
    return f"{mod}.lora_A.weight"


def _b(mod: str) -> str:
    return f"{mod}.lora_B.weight"


def alpha_for(scaling: float, rank: int, rslora: bool) -> float | int:
    """An alpha whose ``alpha / rank`` (``alpha / sqrt(rank)``) is ``scaling`` exactly, as PEFT and NxD compute it;
    an integer when one is exact."""
    d = math.sqrt(rank) if rslora else rank
    a = scaling * d
    cands, up, down = [float(round(a)), a], a, a
    for _ in range(16):  # the quotient's rounding moves by less than one unit per step of alpha
        up, down = math.nextafter(up, math.inf), math.nextafter(down, -math.inf)
        cands += [up, down]
    for c in cands:
        if c > 0 and c / d == scaling:
            return int(c) if c.is_integer() else c
    raise LayoutError(
        f"no lora_alpha gives scaling {scaling!r} at rank {rank}{' (rsLoRA)' if rslora else ''} exactly; "
        "the adapter cannot be widened for NxD without rescaling lora_B"
    )


def rank_and_alpha(scaling: float, least: int, rslora: bool) -> tuple[int, float | int]:
    """The smallest NxD rank ``>= least`` with an alpha giving ``scaling`` exactly (more zero padding is exact too;
    with rsLoRA, ``alpha / sqrt(rank)`` cannot hit every scaling at every rank), and that alpha."""
    for rank in range(least, 2 * least + 8):
        try:
            return rank, alpha_for(scaling, rank, rslora)
        except LayoutError:
            continue
    raise LayoutError(
        f"no lora_rank from {least} with a lora_alpha giving scaling {scaling!r} exactly; the adapter cannot be "
        "widened for NxD without rescaling lora_B"
    )


@dataclass(frozen=True)
class Layer:
    """One NxD LoRA layer and the HF modules it holds (in NxD's order), with the rank each has in the adapter and, for
    a part whose ``lora_A`` (and its optimizer state) is bit-identical to an earlier part's, that part's index: they
    share one block of rows (a widened adapter that comes back wide, re-laid out, is not widened twice)."""

    nxd: str
    parts: tuple[str, ...]
    ranks: tuple[int, ...]
    shares: tuple[int | None, ...]

    @property
    def width(self) -> int:
        return sum(r for r, sh in zip(self.ranks, self.shares, strict=True) if sh is None)

    def offset(self, i: int) -> int:
        if self.shares[i] is not None:
            return self.offset(self.shares[i])  # type: ignore[arg-type]
        return sum(r for r, sh in zip(self.ranks[:i], self.shares[:i], strict=True) if sh is None)


def _same_a(adapter: Adapter, p: str, q: str) -> bool:
    """``p`` and ``q`` have bit-identical ``lora_A`` and optimizer state of it."""
    if not bit_equal(adapter.tensors[_a(p)], adapter.tensors[_a(q)]):
        return False
    state = (adapter.optimizer or {}).get("state", {})
    sp, sq = state.get(_a(p), {}), state.get(_a(q), {})
    if sp.keys() != sq.keys():
        return False
    for k, v in sp.items():
        w = sq[k]
        same = bit_equal(v, w) if isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) else v == w
        if not same:
            return False
    return True


def layers_of(adapter: Adapter, spec: LayoutSpec) -> list[Layer]:
    """The NxD LoRA layers ``adapter`` lays out to (a fused part the adapter lacks has rank 0)."""
    out: dict[str, Layer] = {}
    for mod in adapter.modules:
        nxd = nxd_lora_name(_a(mod), spec).removesuffix(".lora_A.weight")
        if nxd in out:
            continue
        parts = tuple(parse_hf(h)[0] for h in hf_lora_names(f"{nxd}.lora_A.weight"))
        ranks = tuple(adapter.rank_of(p) if p in adapter.modules else 0 for p in parts)
        shares: list[int | None] = []
        for i, p in enumerate(parts):
            same = [
                j
                for j in range(i)
                if ranks[j] and ranks[i] and shares[j] is None and _same_a(adapter, parts[j], p)
            ]
            shares.append(same[0] if same else None)
        out[nxd] = Layer(nxd, parts, ranks, tuple(shares))
    return list(out.values())


def needs_widening(adapter: Adapter, layers: list[Layer]) -> bool:
    """False when NxD holds ``adapter`` as it is: one rank everywhere, fused parts all present with one lora_A."""
    if len({adapter.rank_of(m) for m in adapter.modules}) > 1:
        return True
    for layer in layers:
        if 0 in layer.ranks:
            return True
        if any(not _same_a(adapter, layer.parts[0], p) for p in layer.parts[1:]):
            return True
    return False


def _scaling(adapter: Adapter) -> float:
    """The one scaling every module has; refused (one line) when they differ."""
    by: dict[float, str] = {}
    for m in adapter.modules:
        by.setdefault(adapter.scaling_of(m), m)
    if len(by) > 1:
        (s1, m1), (s2, m2) = sorted(by.items())[:2]
        raise LayoutError(
            f"rank_pattern/alpha_pattern: {m1} has scaling {s1!r}, {m2} has {s2!r}; NxD's LoraConfig has one "
            "scaling (lora_alpha / lora_rank) for every layer, so this adapter has no exact NxD form"
        )
    return next(iter(by))


def _widen_tensors(
    tensors: Mapping[str, torch.Tensor], layers: list[Layer], width: int, spec: LayoutSpec,
    like: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:  # fmt: skip
    """``tensors`` (the adapter's matrices, or one optimizer moment of each) widened to rank ``width``."""
    out: dict[str, torch.Tensor] = {}
    for layer in layers:
        present = next(p for p, r in zip(layer.parts, layer.ranks, strict=True) if r)
        a0 = like[_a(present)]
        wide_a = torch.zeros((width, a0.shape[1]), dtype=tensors[_a(present)].dtype)
        for i, (p, r) in enumerate(zip(layer.parts, layer.ranks, strict=True)):
            if r:
                wide_a[layer.offset(i) : layer.offset(i) + r] = tensors[_a(p)]
        for i, (p, r) in enumerate(zip(layer.parts, layer.ranks, strict=True)):
            out[_a(p)] = wide_a.clone()
            rows = expected_shape(_b(p), spec, width)[0]
            wide_b = torch.zeros((rows, width), dtype=tensors[_b(present)].dtype)
            if r:
                wide_b[:, layer.offset(i) : layer.offset(i) + r] = tensors[_b(p)]
            out[_b(p)] = wide_b
    return out


def _widen_optimizer(
    optimizer: Mapping[str, Any], adapter: Adapter, layers: list[Layer], width: int, spec: LayoutSpec
) -> dict[str, Any]:
    """The optimizer state of the widened adapter: moments laid like their parameters (stacked for ``lora_A``, in
    the blocks of ``lora_B``, zeros elsewhere); scalar state (``step``) of an added part is its layer's."""
    state: Mapping[str, Mapping[str, Any]] = optimizer["state"]
    keys = {k for per in state.values() for k in per}
    moments = {
        k
        for k in keys
        if all(
            isinstance(state.get(n, {}).get(k), torch.Tensor)
            and tuple(state[n][k].shape) == tuple(t.shape)
            and state[n][k].dim() > 0
            for n, t in adapter.tensors.items()
        )
    }
    new: dict[str, dict[str, Any]] = {}
    for key in sorted(moments):
        wide = _widen_tensors(
            {n: state[n][key] for n in adapter.tensors}, layers, width, spec, adapter.tensors
        )
        for n, t in wide.items():
            new.setdefault(n, {})[key] = t
    for layer in layers:
        present = next(p for p, r in zip(layer.parts, layer.ranks, strict=True) if r)
        for p, r in zip(layer.parts, layer.ranks, strict=True):
            for ab in (_a, _b):
                src = state.get(ab(p if r else present), {})
                for key, v in src.items():
                    if key not in moments:
                        new.setdefault(ab(p), {})[key] = v
    groups = []
    for g in optimizer["param_groups"]:
        params = list(g["params"])
        for layer in layers:
            present = next(p for p, r in zip(layer.parts, layer.ranks, strict=True) if r)
            for p, r in zip(layer.parts, layer.ranks, strict=True):
                if not r and _a(present) in params:
                    params += [_a(p), _b(p)]
        groups.append({**g, "params": params})
    return {"state": new, "param_groups": groups}


def widen(adapter: Adapter, spec: LayoutSpec) -> tuple[Adapter, dict[str, Any] | None]:
    """``adapter`` as NxD's layers in ``spec`` can hold it, and the widening record (None: held as it is)."""
    layers = layers_of(adapter, spec)
    if not needs_widening(adapter, layers):
        return adapter, None
    scaling = _scaling(adapter)
    width, alpha = rank_and_alpha(scaling, max(layer.width for layer in layers), adapter.use_rslora)
    tensors = _widen_tensors(adapter.tensors, layers, width, spec, adapter.tensors)
    optimizer = (
        _widen_optimizer(adapter.optimizer, adapter, layers, width, spec) if adapter.optimizer else None
    )
    modules: dict[str, Any] = {}
    for layer in layers:
        for i, (p, r) in enumerate(zip(layer.parts, layer.ranks, strict=True)):
            modules[p] = {"layer": layer.nxd, "r": r, "offset": layer.offset(i),
                          "alpha": adapter.alpha_of(p) if r else None}  # fmt: skip
    record = {"lora_rank": width, "lora_alpha": alpha, "scaling": scaling, "modules": modules}
    wide = replace(adapter, tensors=tensors, r=width, lora_alpha=alpha, optimizer=optimizer, notes=())
    return wide, record


def _leaf(mod: str) -> str:
    return mod.rsplit(".", 1)[-1]


def widen_note(record: Mapping[str, Any]) -> str:
    """The one summary line of a widening: which NxD layers, of what, to which rank, with which alpha."""
    by_leaf: dict[str, dict[str, set[int]]] = {}
    for mod, m in record["modules"].items():
        by_leaf.setdefault(_leaf(m["layer"]), {}).setdefault(_leaf(mod), set()).add(m["r"])
    fused, padded = [], []
    for leaf, parts in sorted(by_leaf.items()):
        spelled = " + ".join(f"{p} r{'/'.join(map(str, sorted(rs)))}" for p, rs in parts.items())
        (fused if len(parts) > 1 else padded).append(f"{leaf} ({spelled})" if len(parts) > 1 else spelled)
    rank, alpha = record["lora_rank"], record["lora_alpha"]
    line = f"LoRA widened for NxD to lora_rank {rank}, lora_alpha {alpha} (scaling {record['scaling']} unchanged): "
    line += "fused " + ", ".join(fused) if fused else "no fused layer"
    if padded:
        line += "; zero-padded " + ", ".join(padded)
    return line + " (exact; off-diagonal lora_B blocks start at zero and train on Trainium)"


# ------------------------------------------------------------------------------------------------ back


def _off_zero(t: torch.Tensor, lo: int, hi: int) -> bool:
    return not bool(t[:, :lo].any()) and not bool(t[:, hi:].any())


def _cut(t: torch.Tensor, dim: int, rows: slice) -> torch.Tensor:
    return t.narrow(dim, rows.start, rows.stop - rows.start).clone()


def _check_ranks(adapter: Adapter, where: str) -> None:
    """Every module's tensors have the rank its PEFT config resolves to (the patterns written say what they hold)."""
    for mod in adapter.modules:
        got = adapter.tensors[_a(mod)].shape[0]
        if adapter.rank_of(mod) != got:
            raise LayoutError(
                f"{where}: {mod} comes back with rank {got}, but the PEFT config would give it "
                f"{adapter.rank_of(mod)}; no PEFT config spells this adapter"
            )


def narrow(adapter: Adapter, record: Mapping[str, Any], where: str) -> Adapter:
    """Inverse of :func:`widen` for a wide adapter read from an NxD tag (every module rank ``R``, fused parts'
    ``lora_A`` copies of one tensor): the original PEFT adapter where the off-diagonal blocks are still zero, an
    exact wider-rank PEFT adapter for the modules where training filled them (said in ``notes``)."""
    mods: Mapping[str, Mapping[str, Any]] = record["modules"]
    width, scaling = int(record["lora_rank"]), float(record["scaling"])
    if adapter.r != width or set(adapter.modules) != set(mods):
        raise LayoutError(
            f"{where}: the LoRA tensors (rank {adapter.r}, {len(adapter.modules)} modules) are not the ones "
            f"{RECORD_KEY} describes (rank {width}, {len(mods)} modules)"
        )
    state = (adapter.optimizer or {}).get("state", {})
    used: dict[str, int] = {}
    for m in mods.values():
        used[m["layer"]] = max(used.get(m["layer"], 0), m["offset"] + m["r"])
    tensors: dict[str, torch.Tensor] = {}
    new_state: dict[str, dict[str, Any]] = {}
    wide: dict[str, int] = {}
    for mod, m in mods.items():
        b = adapter.tensors[_b(mod)]
        lo, hi = m["offset"], m["offset"] + m["r"]
        b_moments = [
            v for v in state.get(_b(mod), {}).values() if isinstance(v, torch.Tensor) and v.shape == b.shape
        ]
        if _off_zero(b, lo, hi) and all(_off_zero(v, lo, hi) for v in b_moments):
            if not m["r"]:
                continue  # a part added by the widening, untouched: it was not in the adapter
            rows = slice(lo, hi)
        else:
            keep = used[m["layer"]]
            if b[:, keep:].any() or any(v[:, keep:].any() for v in b_moments):
                keep = width
            keep = _exact_rank(scaling, keep, width, adapter.use_rslora)
            rows = slice(0, keep)
            wide[mod] = keep
        for ab, dim in ((_a, 0), (_b, 1)):
            t = adapter.tensors[ab(mod)]
            tensors[ab(mod)] = _cut(t, dim, rows)
            if ab(mod) in state:
                new_state[ab(mod)] = {
                    k: _cut(v, dim, rows) if isinstance(v, torch.Tensor) and v.shape == t.shape else v
                    for k, v in state[ab(mod)].items()
                }
    optimizer = None
    if adapter.optimizer is not None:
        groups = [
            {**g, "params": [n for n in g["params"] if n in tensors]}
            for g in adapter.optimizer["param_groups"]
        ]
        optimizer = {"state": new_state, "param_groups": groups}
    peft_cfg = dict(adapter.peft_config)
    if not peft_cfg:
        raise LayoutError(f"{where}: {RECORD_KEY} without the PEFT config it was widened from (peft_config)")
    notes: tuple[str, ...] = ()
    if wide:
        peft_cfg = _wide_config(peft_cfg, wide, scaling, adapter.use_rslora, where)
        layers = sorted({_leaf(mods[m]["layer"]) for m in wide})
        ranks = sorted(set(wide.values()))
        notes = (
            f"LoRA: training on NxD filled the off-diagonal blocks of {', '.join(layers)} in "
            f"{len({mods[m]['layer'] for m in wide})} layers: {len(wide)} modules return with rank "
            f"{'/'.join(map(str, ranks))} (the layer's shared lora_A, their own lora_B rows; rank_pattern/"
            f"alpha_pattern, scaling {scaling} unchanged), the others with their original rank",
        )
    else:
        notes = (
            "LoRA: NxD's widened layers returned to the original PEFT adapter (off-diagonal blocks are zero)",
        )
    out = Adapter(
        tensors=tensors, r=int(peft_cfg["r"]), lora_alpha=peft_cfg["lora_alpha"], use_rslora=adapter.use_rslora,
        lora_dropout=adapter.lora_dropout, peft_config=peft_cfg, optimizer=optimizer, notes=notes,
        training=adapter.training,
    )  # fmt: skip
    _check_ranks(out, where)
    return out


def _exact_rank(scaling: float, least: int, width: int, rslora: bool) -> int:
    """The smallest rank in ``[least, width]`` whose alpha can give ``scaling`` exactly (``width``, NxD's, can); the
    columns between are zero padding, exact to keep."""
    for rank in range(least, width):
        try:
            alpha_for(scaling, rank, rslora)
            return rank
        except LayoutError:
            continue
    return width


def _wide_config(
    cfg: dict[str, Any], wide: Mapping[str, int], scaling: float, rslora: bool, where: str
) -> dict[str, Any]:
    """``cfg`` with ``rank_pattern``/``alpha_pattern`` entries giving each module of ``wide`` its rank (and an alpha
    keeping ``scaling``); checked against PEFT's own pattern resolution in the order the file will list them."""
    ranks = dict(cfg.get("rank_pattern") or {})
    alphas = dict(cfg.get("alpha_pattern") or {})
    for mod, rank in wide.items():
        ranks[mod] = rank
        alphas[mod] = alpha_for(scaling, rank, rslora)  # the rank NxD held it at has one
    out = {**cfg, "rank_pattern": dict(sorted(ranks.items())), "alpha_pattern": dict(sorted(alphas.items()))}
    targets = out.get("target_modules")
    if isinstance(targets, list):
        out["target_modules"] = sorted(set(targets) | {_leaf(m) for m in wide})
    for mod, rank in wide.items():
        got = out["rank_pattern"][pattern_key(out["rank_pattern"], mod)]
        got_a = out["alpha_pattern"][pattern_key(out["alpha_pattern"], mod)]
        if got != rank or got_a != alphas[mod]:
            raise LayoutError(
                f"{where}: {mod} returns with rank {rank}, but the PEFT config's rank_pattern/alpha_pattern key "
                f"{pattern_key(out['rank_pattern'], mod)!r} would give it {got}; no PEFT config spells this adapter"
            )
    return out


__all__ = [
    "RECORD_KEY",
    "alpha_for",
    "layers_of",
    "narrow",
    "needs_widening",
    "rank_and_alpha",
    "widen",
    "widen_note",
]
