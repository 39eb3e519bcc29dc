"""Lightning's checkpoint *folders*: what its FSDP and DeepSpeed strategies write where ``ModelCheckpoint`` names
a ``.ckpt`` path.

- FSDP with ``state_dict_type="sharded"``: a DCP folder (``.metadata``, ``__<rank>_0.distcp``) holding
  ``{"model": ..., "optimizer_<k>": ...}`` plus ``meta.pt``, ``torch.save`` of the rest of Lightning's dict (loops,
  callbacks, ...).  Read as DCP (:class:`~converters.dcp_source.DCPSource`: model tensors, and the optimizer's
  moments, FQN-keyed as FSDP saves them, when there is one optimizer); ``meta.pt`` through the safe unpickler into
  ``extra.lightning_meta`` (JSON), its ``global_step`` the step.
- DeepSpeed: ``checkpoint/*mp_rank_00_model_states.pt`` and ZeRO ``*_optim_states.pt`` partitions: read by
  :mod:`converters.lightning_deepspeed` (without DeepSpeed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt.errors import CkptError
from ckpt.format import treecodec
from ckpt.safe_unpickle import load_torch_file

from .dcp_source import METADATA_NAME, DCPSource
from .lightning_pickle import allowed_globals

#: the file Lightning's FSDP strategy writes beside the DCP shards
META_NAME = "meta.pt"
def is_fsdp_sharded(path: Path) -> bool:
    return path.is_dir() and (path / META_NAME).is_file() and (path / METADATA_NAME).is_file()


def is_deepspeed(path: Path) -> bool:
    from ckpt.restoring.other_tools import deepspeed_folder

    return path.is_dir() and deepspeed_folder(str(path))


class FsdpShardedSource(DCPSource):
    """Lightning's FSDP sharded checkpoint folder (see the module docstring)."""

    title = "Lightning FSDP sharded"
    format = "lightning"
    #: one optimizer (``optimizer_0``) is read as the optimizer; a second one is listed in ``extra.dcp_ignored``
    optim_keys = ("optimizer_0",)

    def __init__(self, path: str | Path, *, config: dict[str, Any] | None = None) -> None:
        meta = load_torch_file(Path(path) / META_NAME, allowed_globals())
        if not isinstance(meta, dict):
            raise CkptError(f"{Path(path) / META_NAME}: not Lightning's checkpoint metadata (a {type(meta).__name__})")
        super().__init__(path, config=config, step=int(meta.get("global_step", 0) or 0))
        self.trees.extra["lightning_meta"] = treecodec.encode(meta, "meta.pt")
        self.step_recorded = "global_step" in meta


__all__ = ["FsdpShardedSource", "META_NAME", "is_deepspeed", "is_fsdp_sharded"]
