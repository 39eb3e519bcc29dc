"""Rank body for test_optimum_lora.py: optimum-neuron's ``NeuronPeftModel.from_pretrained`` on its own training
``LlamaForCausalLM`` at TP > 1 (one gloo process per TP rank, NxD in CPU mode): what each rank holds after loading a
consolidated adapter (``get_peft_model_state_dict``, the dict its save hands NxD's ``save_checkpoint``)."""

from __future__ import annotations

import os
from typing import Any


def run(rank: int, world: int, cases: list[tuple[dict, str]]) -> dict[str, Any]:
    """``cases``: ``(config, consolidated adapter folder)`` each, loaded one after the other in this process."""
    os.environ.update(NXD_CPU_MODE="1", PJRT_DEVICE="CPU")
    from neuronx_distributed.parallel_layers import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    from optimum.neuron.models.training import LlamaForCausalLM, TrainingNeuronConfig
    from optimum.neuron.peft import NeuronPeftModel
    from optimum.neuron.peft.utils.save_and_load import get_peft_model_state_dict
    from transformers import LlamaConfig

    states = []
    for cfg, adapter_dir in cases:
        model = LlamaForCausalLM(LlamaConfig(**cfg), TrainingNeuronConfig(tensor_parallel_size=world))
        peft_model = NeuronPeftModel.from_pretrained(model, adapter_dir)
        states.append({k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()})
    return {"tp": ps.get_tensor_model_parallel_rank(), "states": states}
