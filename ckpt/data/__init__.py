"""Data position across a change of DP size: adapters per loader kind, the global position, re-splitting.

Saving: every rank's loader ``state_dict`` is stored as before (``manifest.data[rank]``), and, when an adapter
knows the loader, its :class:`RankPosition`; rank 0 merges those into the manifest's ``data_position``.
Restoring (:func:`restore`): an adapter that knows the loader continues the global position on any number of
ranks; a loader no adapter knows gets its own rank's state back when the DP size is unchanged, and a clear
``StateMismatchError`` naming :func:`register` when it changed.  Rules: docs/guide.md, "Changing the number of
ranks".
"""

from __future__ import annotations

from ckpt import lazy

# Public name -> defining module; imported on first use so that ``ckpt.data.digest`` (used by verify-resume)
# does not import torch.
_EXPORTS = {
    "DataAdapter": "adapters",
    "adapter_for": "adapters",
    "register": "adapters",
    "unregister": "adapters",
    "combine_digests": "digest",
    "global_digest": "digest",
    "sample_digest": "digest",
    "DataPosition": ".format.data_position",
    "RankPosition": ".format.data_position",
    "DataRestore": "positioning",
    "merge_json": "positioning",
    "position_of": "positioning",
    "restore": "positioning",
    "SplitDataset": "hf_split",
    "split_dataset_by_node": "hf_split",
    "SplitIterable": "hf_iterable",
    "split_iterable_by_node": "hf_iterable",
    "TrackedLoader": "tracked",
    "track": "tracked",
}


__getattr__ = lazy.exports(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
