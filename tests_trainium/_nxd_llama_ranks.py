"""Rank body for tests_trainium/test_nxd_llama_model.py: NxD's own training Llama, built and loaded as NxD's example
trainer does it, on one gloo process per TP rank (the XLA CPU device, ``tests/nxd_shim/xla_gloo.py``).

Run as ``python _nxd_llama_ranks.py <job.json>`` with ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``
set, and ``PYTHONPATH`` holding, in this order: transformers 4.48 (what NxD's ``examples/training/llama/
requirements.txt`` pins; ``modeling_llama_nxd.py`` subclasses its internals), ``tests/nxd_shim``, NxD's ``src/``.
For each case of the job, in this process: NxD's parallel state for the case's platform (``NXD_SHIM_PLATFORM``),
``initialize_parallel_model(neuronx_distributed_config(...), get_model)`` with ``get_model`` doing what
``tp_zero1_llama_hf_pretrain.py``'s does (``LlamaConfig.from_pretrained`` plus the NxD attributes it sets), then
``load_checkpoint(path, tag, model=model)`` (NxD's loader: its strict ``load_state_dict`` of this rank's file), and
a forward of the job's token ids.  Each rank writes its vocabulary slice of the logits (``lm_head`` is NxD's
``ColumnParallelLinear`` with ``gather_output=False``) to ``<out>/logits_tp<rank>.safetensors``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _get_model(config_dir: str, kv_size_multiplier: int) -> Any:
    """What the example's ``get_model`` builds (``tp_zero1_llama_hf_pretrain.py``), at this config's sizes."""
    from modeling_llama_nxd import LlamaForCausalLM
    from transformers import LlamaConfig

    config = LlamaConfig.from_pretrained(config_dir)
    config.use_cache = False
    config.kv_shared_group_size = kv_size_multiplier
    config.qkv_linear = True
    config.use_flash_attention = False  # the example's default (--use_flash_attention 0): CoreAttention
    config.transpose_nki_inputs = False
    config.fuse_qkv = False
    config.sequence_parallel_enabled = False
    config.selective_checkpoint_enabled = False
    config.head_dim = config.hidden_size // config.num_attention_heads
    return LlamaForCausalLM(config)


def _case(case: dict[str, Any], ids: Any, world: int) -> None:
    import torch
    import torch_xla
    from neuronx_distributed.parallel_layers import parallel_state as ps
    from neuronx_distributed.trainer import (
        initialize_parallel_model,
        load_checkpoint,
        neuronx_distributed_config,
    )
    from safetensors.torch import save_file

    os.environ["NXD_SHIM_PLATFORM"] = case["platform"]
    nxd_config = neuronx_distributed_config(
        tensor_parallel_size=world,
        optimizer_config={"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": 1.0},
        mixed_precision_config={"use_master_weights": False, "use_fp32_grad_acc": False,
                                "use_master_weights_in_ckpt": False},
    )  # fmt: skip
    model = initialize_parallel_model(
        nxd_config, _get_model, False, case["config_dir"], case["kv_size_multiplier"]
    )
    load_checkpoint(case["path"], tag=case["tag"], model=model)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids).to(torch_xla.device())).logits
    out = Path(case["out"])
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {"logits": logits.cpu().contiguous()},
        str(out / f"logits_tp{ps.get_tensor_model_parallel_rank()}.safetensors"),
    )
    ps.destroy_model_parallel()
    # NxD's destroy_model_parallel keeps the KV-shared group (one process, one training); the next case may replicate
    # KV differently, so it is cleared as a fresh process would have it
    ps._KV_SHARED_GROUP = ps._KV_SHARED_GROUP_SPMD = ps._KV_SHARED_GROUP_SIZE = None


def main(job_file: str) -> None:
    start = time.perf_counter()
    import torch
    import torch.distributed as dist

    job = json.loads(Path(job_file).read_text())
    torch.set_num_threads(1)
    sys.path.insert(0, job["llama_example"])  # modeling_llama_nxd, as the example's scripts import it
    dist.init_process_group("gloo")
    import xla_gloo

    xla_gloo.install()
    try:
        for case in job["cases"]:
            began = time.perf_counter()
            _case(case, job["ids"], dist.get_world_size())
            print(
                f"case {case['name']}: {time.perf_counter() - began:.1f} s (process start {began - start:.1f} s)"
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
