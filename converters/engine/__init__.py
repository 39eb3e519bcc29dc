"""The conversion engine: sources hand out pieces, plans say which pieces make which output, exports write units.

* :mod:`.source`: the :class:`Source` protocol every input format implements;
* :mod:`.trees`: the non-tensor state (:class:`Trees`) and its renaming between layouts;
* :mod:`.plan`: frozen plans (:class:`Conversion`) from a source to a CUDA or Neuron target;
* :mod:`.compose`: plan algebra (renaming, composing a target plan with the full view, replica de-duplication);
* :mod:`.execute`: making each target part from its pieces (replicas compared);
* :mod:`.export`: the :class:`Export` protocol every output format implements (units + commit);
* :mod:`.run`: running an export in one process, N worker processes or torchrun ranks.

No format lives here: each is one module of :mod:`ckpt.converters` (``ckpt``, ``hf``, ``dcp``, ``nxd``).
"""

from .execute import produce, write_share
from .export import Export, Staging, UnitReceipt, balance, check_cover
from .plan import Conversion, OutPart, OutTensor, full_view, plan_same_layout, plan_to_cuda, plan_to_neuron
from .run import run_serial, run_torchrun, run_workers
from .source import MODEL_ROLES, LayoutKind, Rank, Source, slice_of
from .trees import Trees

__all__ = [
    "Conversion",
    "Export",
    "LayoutKind",
    "MODEL_ROLES",
    "OutPart",
    "OutTensor",
    "Rank",
    "Source",
    "Staging",
    "Trees",
    "UnitReceipt",
    "balance",
    "check_cover",
    "full_view",
    "plan_same_layout",
    "plan_to_cuda",
    "plan_to_neuron",
    "produce",
    "run_serial",
    "run_torchrun",
    "run_workers",
    "slice_of",
    "write_share",
]
