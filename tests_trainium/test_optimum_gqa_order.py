"""The head order ckpt writes for an optimum-neuron GQA layout is optimum-neuron's own, for every shape it accepts.

optimum-neuron 0.4.5 places the query heads of TP rank ``r`` with ``GQAQKVColumnParallelLinearSpec.
compute_query_indices_for_rank`` (``transformations_utils.py:809-849``; ``o_proj``'s columns follow them) and the KV
heads as chunk ``r`` of ``W.repeat(kv_size_multiplier)`` (``:852-864``).  ckpt's trn1 GQA layout
(``ckpt.layouts.gqa``, what ``--format optimum-neuron`` writes) must hold the same heads in the same order on every
rank: a property over head counts, TP degrees and multipliers, against optimum-neuron's own functions.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.errors import LayoutError
from ckpt.layouts import gqa
from ckpt.layouts.spec import LayoutSpec


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, int, int, int]:
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    tp = draw(st.sampled_from([2, 4, 8, 16, 32]))
    mult = draw(st.sampled_from([max(1, tp // kv), 2 * max(1, tp // kv)]))
    return kv * group, kv, tp, mult


@settings(max_examples=150, deadline=None)
@given(shapes())
def test_ckpt_places_query_and_kv_heads_where_optimum_neuron_does(shape: tuple[int, int, int, int]) -> None:
    from optimum.neuron.models.training.transformations_utils import GQAQKVColumnParallelLinearSpec as Spec

    heads, kv, tp, mult = shape
    config = {"model_type": "llama", "hidden_size": heads * 8, "num_attention_heads": heads,
              "num_key_value_heads": kv, "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 64}  # fmt: skip
    try:
        spec = LayoutSpec.from_hf_config(config, tp=tp, qkv_linear=True, kv_size_multiplier=mult)
    except LayoutError:
        return  # a shape NxD cannot lay out (heads or KV copies not divisible over the ranks): refused, not written
    per_rank_kv = kv * mult // tp
    tiled = torch.arange(kv).repeat(mult)
    for rank in range(tp):
        theirs = Spec.compute_query_indices_for_rank(tp, rank, heads, kv, mult).tolist()
        assert list(gqa.q_heads_of_rank(spec, rank)) == theirs, (shape, rank)
        assert (
            list(gqa.kv_heads_of_rank(spec, rank))
            == tiled[rank * per_rank_kv : (rank + 1) * per_rank_kv].tolist()
        )
