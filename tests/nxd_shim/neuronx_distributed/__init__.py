# SHIM: replaces only the body of NxD's top-level __init__.py (which eagerly imports the trainer, tracing, kernels and
# the Neuron compiler).  Every NxD module is still NxD's own, unmodified file, found through __path__ (NXD_SRC); the
# shim directory comes first only so that the one package __init__ below (modules/moe) is shadowed.
import os as _os

__path__ = [
    _os.path.dirname(_os.path.abspath(__file__)),
    _os.path.join(_os.environ["NXD_SRC"], "neuronx_distributed"),
]
