"""Checkpointing NxD / torch-xla training on AWS Trainium (docs/nxd.md, "Saving from Neuron training").

torch_xla and neuronx_distributed are imported only when XLA tensors are actually staged or restored, so this
package imports (and its layout logic runs) on any machine.
"""

from .checkpointer import NeuronCheckpointer, NeuronCheckpointManager, NeuronRestorer, restore
from .parallel import ParallelInfo
from .partition import NxdLayout, attribute_partition
from .rng import XLA_RNG
from .stager import XlaStager
from .transfer import to_device, to_host
from .zero1 import capture_zero1, is_zero1_optimizer, restore_zero1

__all__ = [
    "NeuronCheckpointManager",
    "NeuronCheckpointer",
    "NeuronRestorer",
    "NxdLayout",
    "ParallelInfo",
    "XLA_RNG",
    "XlaStager",
    "attribute_partition",
    "capture_zero1",
    "is_zero1_optimizer",
    "restore",
    "restore_zero1",
    "to_device",
    "to_host",
]
