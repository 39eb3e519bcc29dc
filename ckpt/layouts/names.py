"""NxD <-> Hugging Face tensor names for Llama-, Mistral- and Qwen2-style decoders.

Only attention projections and the MLP's gate/up differ; every other name (embeddings, norms, o_proj,
down_proj, lm_head) is identical in both worlds, and PP keeps the global layer index.

=====================================  =========================================================
HF                                     NxD
=====================================  =========================================================
``self_attn.{q,k,v}_proj.weight``      unchanged (``ColumnParallelLinear``, MHA or ``tp | kv_heads``)
                                       ``self_attn.qkv_proj.weight_{q,k,v}`` with ``qkv_linear``
                                       ``self_attn.qkv_proj.weight_qkv`` with ``qkv_linear`` + ``fuse_qkv``
                                       ``self_attn.qkv_proj.weight`` with ``fuse_qkv`` on MHA (stride 3)
``self_attn.{q,k,v}_proj.bias``        the same with ``bias`` (``bias_q``, ``bias_qkv``, ...; Qwen2)
``mlp.{gate,up}_proj.{weight,bias}``   ``mlp.gate_up_proj.{weight,bias}`` (always fused)
=====================================  =========================================================
"""

from __future__ import annotations

import re

from ckpt.layouts.spec import LayoutSpec

_QKV_HF = re.compile(r"^(?P<pre>.*\.self_attn\.)(?P<p>[qkv])_proj\.(?P<kind>weight|bias)$")
_QKV_NXD = re.compile(r"^(?P<pre>.*\.self_attn\.)qkv_proj\.(?P<kind>weight|bias)(_(?P<p>qkv|q|k|v))?$")
_GATE_UP_HF = re.compile(r"^(?P<pre>.*\.mlp\.)(gate|up)_proj\.(?P<kind>weight|bias)$")
_GATE_UP_NXD = re.compile(r"^(?P<pre>.*\.mlp\.)gate_up_proj\.(?P<kind>weight|bias)$")


def hf_to_nxd_name(name: str, spec: LayoutSpec) -> str:
    """NxD name of the tensor that HF tensor ``name`` is stored in (fused tensors share one name)."""
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
    return name


def nxd_to_hf_names(name: str) -> tuple[str, ...]:
    """HF tensors stored in NxD tensor ``name``, in the order they are concatenated on each rank (the name alone
    decides it, whatever the layout)."""
    m = _QKV_NXD.match(name)
    if m:
        pre, part, kind = m["pre"], m["p"], m["kind"]
        parts = "qkv" if part in (None, "qkv") else part
        return tuple(f"{pre}{p}_proj.{kind}" for p in parts)
    m = _GATE_UP_NXD.match(name)
    if m:
        return (f"{m['pre']}gate_proj.{m['kind']}", f"{m['pre']}up_proj.{m['kind']}")
    return (name,)


def fusion_group(name: str, spec: LayoutSpec) -> tuple[str, ...]:
    """All HF tensors that must be read together to write HF tensor ``name``'s NxD tensor.

    A streaming full->NxD converter loads exactly this group at a time (at most q, k, v of one layer).
    """
    return nxd_to_hf_names(hf_to_nxd_name(name, spec))
