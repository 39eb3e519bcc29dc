"""NxD <-> Hugging Face tensor names, per model family.

Dense decoders differ only in the attention projections and the MLP's gate/up; every other name (embeddings, norms,
o_proj, down_proj, lm_head, q_norm/k_norm) is identical in both worlds, and PP keeps the global layer index.  A family
may rename more (``Family.renames``: Mixtral's router) and, for MoE, stores its experts stacked
(``Family.experts``, below).

=====================================  =========================================================
HF                                     NxD
=====================================  =========================================================
``self_attn.{q,k,v}_proj.weight``      unchanged (``ColumnParallelLinear``, MHA or ``tp | kv_heads``)
                                       ``self_attn.qkv_proj.weight_{q,k,v}`` with ``qkv_linear``
                                       ``self_attn.qkv_proj.weight_qkv`` with ``qkv_linear`` + ``fuse_qkv``
                                       ``self_attn.qkv_proj.weight`` with ``fuse_qkv`` on MHA (stride 3)
``self_attn.{q,k,v}_proj.bias``        the same with ``bias`` (``bias_q``, ``bias_qkv``, ...; Qwen2)
``mlp.{gate,up}_proj.{weight,bias}``   ``mlp.gate_up_proj.{weight,bias}`` (always fused)
MoE router (``block_sparse_moe.gate``) ``mlp.router.linear_router.weight``
expert ``j`` gate and up               ``mlp.expert_mlps.mlp_op.gate_up_proj.weight#j`` (expert view, below)
expert ``j`` down                      ``mlp.expert_mlps.mlp_op.down_proj.weight#j``
=====================================  =========================================================

Expert views.  NxD stores all of a rank's experts in one 3-d tensor (``gate_up_proj.weight`` ``[E/ep, H, 2I/tp]``,
``down_proj.weight`` ``[E/ep, I/tp, H]``).  The planner sees each expert ``j`` (global index) as its own 2-d tensor
``<stacked name>#j``, the transpose of slot ``j mod E/ep`` on EP rank ``j div E/ep``: ``[2I/tp, H]`` =
``cat[gate_j rows, up_j rows]`` exactly like a dense ``gate_up_proj`` and ``[H, I/tp]`` like a dense ``down_proj``,
so experts are planned by the dense rules; :mod:`ckpt.layouts.experts` stacks and unstacks them.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ckpt.layouts.families import Family, get_family

if TYPE_CHECKING:
    from ckpt.layouts.spec import LayoutSpec

_QKV_HF = re.compile(r"^(?P<pre>.*\.self_attn\.)(?P<p>[qkv])_proj\.(?P<kind>weight|bias)$")
_QKV_NXD = re.compile(r"^(?P<pre>.*\.self_attn\.)qkv_proj\.(?P<kind>weight|bias)(_(?P<p>qkv|q|k|v))?$")
_GATE_UP_HF = re.compile(r"^(?P<pre>.*\.mlp\.)(gate|up)_proj\.(?P<kind>weight|bias)$")
_GATE_UP_NXD = re.compile(r"^(?P<pre>.*\.mlp\.)gate_up_proj\.(?P<kind>weight|bias)$")
_EXPERT_NXD = re.compile(
    r"^(?P<pre>model\.layers\.\d+\.)mlp\.expert_mlps\.mlp_op\.(?P<proj>gate_up|down)_proj\.weight#(?P<j>\d+)$"
)
EXPERT_STACKED = re.compile(
    r"^(?P<pre>model\.layers\.\d+\.)mlp\.expert_mlps\.mlp_op\.(?P<proj>gate_up|down)_proj\.weight$"
)
"""NxD's stacked expert tensors (what rank files and Neuron manifests hold)."""


def _expert_hf(family: Family) -> re.Pattern[str] | None:
    e = family.experts
    if e is None:
        return None
    parts = "|".join(re.escape(p) for p in (e.gate, e.up, e.down))
    return re.compile(
        rf"^(?P<pre>model\.layers\.\d+\.){re.escape(e.block)}experts\.(?P<j>\d+)\.(?P<part>{parts})\.weight$"
    )


def expert_view(name: str) -> tuple[str, int] | None:
    """``(stacked NxD name, global expert index)`` of an expert view name ``...#j``, else None."""
    m = _EXPERT_NXD.match(name)
    if not m:
        return None
    return f"{m['pre']}mlp.expert_mlps.mlp_op.{m['proj']}_proj.weight", int(m["j"])


def hf_to_nxd_name(name: str, spec: LayoutSpec) -> str:
    """NxD name of the tensor that HF tensor ``name`` is stored in (fused tensors share one name; experts: their
    expert view)."""
    family = spec.family
    m = _QKV_HF.match(name)
    if m:
        pre, part, kind = m["pre"], m["p"], m["kind"]
        if spec.qkv_linear:
            return f"{pre}qkv_proj.{kind}_{'qkv' if spec.fuse_qkv else part}"
        if spec.fuse_qkv:
            return f"{pre}qkv_proj.{kind}"
        return name
    m = _GATE_UP_HF.match(name)
    if m:
        return f"{m['pre']}gate_up_proj.{m['kind']}"
    expert = _expert_hf(family)
    m = expert.match(name) if expert is not None else None
    if m:
        proj = "down" if family.experts.hf_parts()[m["part"]] == "down" else "gate_up"  # type: ignore[union-attr]
        return f"{m['pre']}mlp.expert_mlps.mlp_op.{proj}_proj.weight#{m['j']}"
    for rename in family.renames:
        out = rename.forward(name)
        if out is not None:
            return out
    return name


def nxd_to_hf_names(name: str, family: Family | None = None) -> tuple[str, ...]:
    """HF tensors stored in NxD tensor ``name``, in the order they are concatenated on each rank (the name alone
    decides it, whatever the layout; ``family`` defaults to Llama's, which renames nothing)."""
    family = family or get_family("llama")
    m = _QKV_NXD.match(name)
    if m:
        pre, part, kind = m["pre"], m["p"], m["kind"]
        parts = "qkv" if part in (None, "qkv") else part
        return tuple(f"{pre}{p}_proj.{kind}" for p in parts)
    m = _GATE_UP_NXD.match(name)
    if m:
        return (f"{m['pre']}gate_proj.{m['kind']}", f"{m['pre']}up_proj.{m['kind']}")
    m = _EXPERT_NXD.match(name)
    if m and family.experts is not None:
        e = family.experts
        q = f"{m['pre']}{e.block}experts.{m['j']}."
        if m["proj"] == "down":
            return (f"{q}{e.down}.weight",)
        return (f"{q}{e.gate}.weight", f"{q}{e.up}.weight")
    for rename in family.renames:
        out = rename.backward(name)
        if out is not None:
            return (out,)
    return (name,)


def fusion_group(name: str, spec: LayoutSpec) -> tuple[str, ...]:
    """All HF tensors that must be read together to write HF tensor ``name``'s NxD tensor.

    A streaming full->NxD converter loads exactly this group at a time (at most q, k, v of one layer).
    """
    return nxd_to_hf_names(hf_to_nxd_name(name, spec), spec.family)
