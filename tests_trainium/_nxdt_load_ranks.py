"""Rank body for tests_trainium/test_nxdt_load.py: what NxD Training's ``NLPCheckpointIO.load_checkpoint`` does
(aws-neuron/neuronx-distributed-training @ 9169aa0, ``lightning_modules/nlp_overrides.py:547-570``), on one gloo
process per rank: ``nxd.load_checkpoint(dirname(path), basename(path), model={}, optimizer={})`` into empty dicts,
NxD's parallel state as NxD Training sets it for the tag's layout (TP 2, DP 2, ZeRO-1 found by NxD from
``optim/dp_rank_01_*``).  For each tag of the job, the dicts and the returned user content are written, host
tensors only, to ``<out>/<tag index>_rank<r>.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def _host(v: Any) -> Any:
    import torch

    if isinstance(v, torch.Tensor):
        return v.detach().cpu()
    if isinstance(v, dict):
        return {k: _host(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_host(x) for x in v)
    return v


def main(job_file: str) -> None:
    import torch
    import torch.distributed as dist

    job = json.loads(Path(job_file).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import xla_gloo

    xla_gloo.install()
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.trainer import load_checkpoint

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=job["tp"])
    try:
        for i, path in enumerate(job["tags"]):
            model: dict[str, Any] = {}
            optimizer: dict[str, Any] = {}
            user = load_checkpoint(
                os.path.dirname(path), os.path.basename(path), model=model, optimizer=optimizer
            )
            out = {"model": _host(model), "optimizer": _host(optimizer), "user_content": _host(user)}
            torch.save(out, Path(job["out"]) / f"{i}_rank{dist.get_rank()}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
