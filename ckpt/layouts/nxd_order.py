"""NxD's parameter order: the order in which a live NxD model lists its parameters, where ckpt knows it.

Why it matters: NxD resumes with ``optimizer.load_state_dict``, and torch maps saved state to parameters by
*position*: the i-th pid of saved group g goes to the i-th parameter of the live optimizer's group g.  The live
groups list parameters in ``model.named_parameters()`` order (NxD's ``get_param_groups_by_weight_decay`` filters that
list), so an NxD tag's optimizer is loaded onto the right parameters only if each group's pids follow the live
model's parameter order.  This module is the one place that order is written down; the NxD tag writer orders pids
with it and the reader maps pids to names with it when a tag records no ``param_names``.

Known (``nxd-llama``, pipeline size 1): module registration order of NxD 2.29's Llama training model
(``examples/training/llama/modeling_llama_nxd.py`` at fbac349): ``model.embed_tokens``, then per layer
``self_attn`` (``qkv_proj`` -- ``GQAQKVColumnParallelLinear`` registers ``weight_q, weight_k, weight_v`` then
``bias_q, bias_k, bias_v``, or ``weight_qkv, bias_qkv`` fused; the MHA-fused ``ColumnParallelLinear`` ``qkv_proj``
or separate ``q/k/v_proj`` -- each parallel linear registers ``weight`` then ``bias``), ``o_proj``,
``mlp.gate_up_proj``, ``mlp.down_proj``, ``input_layernorm``, ``post_attention_layernorm``; then ``model.norm`` and
``lm_head``.  NxD's own checkpoint converter writes no optimizer, so there is no other numbering to agree with.

Not known (None): other rule sets (Qwen3's ``q_norm``/``k_norm`` and the MoE layers have no NxD 2.29 model to take
the order from), and pipeline parallelism: NxD traces each stage into an FX ``GraphModule`` whose submodules are
created in first-use order of the forward pass (``input_layernorm`` before ``self_attn``), which ckpt has not
checked against a running NxD.  Names outside the table (buffers, LoRA matrices) make the order unknown too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: per-layer parameter suffixes (after ``model.layers.<i>.``) in NxD Llama's registration order
_LLAMA_LAYER = (
    "self_attn.qkv_proj.weight_qkv",
    "self_attn.qkv_proj.bias_qkv",
    "self_attn.qkv_proj.weight_q",
    "self_attn.qkv_proj.weight_k",
    "self_attn.qkv_proj.weight_v",
    "self_attn.qkv_proj.bias_q",
    "self_attn.qkv_proj.bias_k",
    "self_attn.qkv_proj.bias_v",
    "self_attn.qkv_proj.weight",
    "self_attn.qkv_proj.bias",
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "self_attn.o_proj.bias",
    "mlp.gate_up_proj.weight",
    "mlp.gate_up_proj.bias",
    "mlp.down_proj.weight",
    "mlp.down_proj.bias",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
_LLAMA_TOP = {"model.embed_tokens.weight": 0, "model.norm.weight": 2, "lm_head.weight": 3}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

#: rule sets whose NxD parameter order is known (pipeline size 1): rule set -> (top-level slots, per-layer order)
_KNOWN: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "nxd-llama": (_LLAMA_TOP, {s: i for i, s in enumerate(_LLAMA_LAYER)}),
}


def order_known(rule_set: str | None, pp: int) -> bool:
    """Whether :func:`nxd_param_order` can order parameters of this layout at all."""
    return rule_set in _KNOWN and pp == 1


def nxd_param_order(names: Iterable[str], rule_set: str | None, *, pp: int = 1) -> list[str] | None:
    """``names`` (NxD parameter names of one rank) in the order NxD's live model lists them; None where ckpt does
    not know that order (see the module docstring): callers must then refuse or keep an order they can prove."""
    if not order_known(rule_set, pp):
        return None
    assert rule_set is not None
    top, layer = _KNOWN[rule_set]
    keys: dict[str, tuple[int, int, int]] = {}
    for n in names:
        m = _LAYER.match(n)
        if m is not None and m.group(2) in layer:
            keys[n] = (1, int(m.group(1)), layer[m.group(2)])
        elif n in top:
            keys[n] = (top[n], 0, 0)
        else:
            return None
    return sorted(keys, key=keys.__getitem__)


__all__ = ["nxd_param_order", "order_known"]
