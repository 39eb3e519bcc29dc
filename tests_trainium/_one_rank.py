"""One gloo process with NxD's parallel state (TP 1): what optimum-neuron's functions that ask NxD for the TP size
and rank need when a test calls them in-process."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """``torch.distributed`` (gloo, world size 1) and NxD's ``initialize_model_parallel`` (CPU mode), torn down
    after, so that the next test starts clean."""
    import torch.distributed as dist
    from neuronx_distributed.parallel_layers import parallel_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
