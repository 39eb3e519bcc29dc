# SHIM: package __init__ only.  NxD's modules/moe/__init__.py imports ExpertMLPs, whose blockwise kernels need nkilib
# (Neuron kernels).  The fixtures use moe_parallel_layers.py and experts.py, NxD's own unmodified files, found here.
import os as _os

__path__ = [_os.path.join(_os.environ["NXD_SRC"], "neuronx_distributed", "modules", "moe")]
