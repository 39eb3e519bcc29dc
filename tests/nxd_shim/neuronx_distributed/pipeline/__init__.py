# SHIM: package __init__ only.  NxD's imports NxDPPModel (pipeline/model.py), which imports pipeline/trace.py, which
# imports transformers.utils.fx (gone in transformers 5).  The tests build their pipeline stages by hand and never make
# an NxDPPModel; NxD's trainer/checkpoint.py only asks ``isinstance(model, NxDPPModel)``.  Every submodule
# (partition.py, which NxD's checkpoint converter uses) is NxD's own file, found through __path__.
import os as _os

__path__ = [_os.path.join(_os.environ["NXD_SRC"], "neuronx_distributed", "pipeline")]


class NxDPPModel:
    """Stand-in for the class name only: nothing in the tests is an NxDPPModel."""
