"""What the saving process ran on: versions, determinism settings, world size.

The verifier compares these across sessions (a torch or Neuron SDK change means recompilation and possibly
different numerics).  Versions come from package metadata so that nothing heavy is imported to read them.
"""

from __future__ import annotations

import functools
import os
import platform
import socket
import sys
from importlib import metadata
from typing import Any

import torch

PACKAGES = (
    "torch",
    "torch-xla",
    "neuronx-distributed",
    "neuronx-cc",
    "libneuronxla",
    "torch-neuronx",
    "transformers",
    "numpy",
    "ckpt",
)
ENV_VARS = (
    "NEURON_CC_FLAGS",
    "XLA_USE_BF16",
    "XLA_DOWNCAST_BF16",
    "NEURON_RT_STOCHASTIC_ROUNDING_EN",
    "CUBLAS_WORKSPACE_CONFIG",
    "PJRT_DEVICE",
)


@functools.cache
def _version(pkg: str) -> str | None:
    """Installed version of ``pkg`` (cached: reading package metadata parses files, ~2 ms per save otherwise,
    and what a running process imported does not change)."""
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def capture(world_size: int = 1) -> dict[str, Any]:
    versions = {p: v for p in PACKAGES if (v := _version(p)) is not None}
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "versions": versions,
        "cuda": torch.version.cuda,
        "world_size": world_size,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }
    if torch.cuda.is_available():
        env["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env
