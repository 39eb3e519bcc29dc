# SHIM: package __init__ only (NxD's is a docstring); lets modules/moe/__init__.py below be shadowed.
import os as _os

__path__ = [
    _os.path.dirname(_os.path.abspath(__file__)),
    _os.path.join(_os.environ["NXD_SRC"], "neuronx_distributed", "modules"),
]
