"""NeuronX Distributed (NxD) native checkpoints: read and write them without torch_xla.

Public API (see docs/nxd.md):

* discovery: :func:`list_tags`, :func:`latest_tag`, :func:`tag_status` -> :class:`TagInfo` / :class:`TagStatus`
* reading: :func:`open_tag` (lazy, one rank at a time), :func:`read_tag` -> :class:`NxdTag`
* writing: :func:`write_tag`
* ZeRO-1 helpers: :func:`shard_zero1`, :func:`merge_zero1`
* our manifest: :func:`import_tag` (NxD tag -> Neuron-layout checkpoint, streaming), :func:`export_tag`,
  :func:`manifest_to_tag`, :func:`rank_shards`
* the conversion engine's format verbs: :func:`detect`, :func:`open_source` (:class:`NxdTagSource`),
  :func:`export` (:class:`NxdExport`), :func:`is_adapter` (an NxD LoRA tag)
"""

from .discovery import TagInfo, TagStatus, latest_tag, list_tags, tag_status
from .export import NxdExport, export
from .lora import is_lora_tag
from .manifest import export_tag, import_tag, manifest_to_tag, rank_shards
from .naming import RankKey, parse_step
from .reader import NxdTag, NxdTagMeta, NxdTagReader, open_tag, read_tag
from .source import NAME, NxdTagSource, detect, open_source
from .writer import write_tag
from .zero1 import merge_zero1, shard_zero1


def is_adapter(path: str, storage_options: object = None) -> bool:
    """The format table's adapter probe: an NxD tag of LoRA matrices (:func:`~.lora.is_lora_tag`)."""
    return is_lora_tag(path)


__all__ = [
    "NAME",
    "NxdExport",
    "NxdTagSource",
    "detect",
    "export",
    "is_adapter",
    "open_source",
    "NxdTag",
    "NxdTagMeta",
    "NxdTagReader",
    "RankKey",
    "TagInfo",
    "TagStatus",
    "export_tag",
    "import_tag",
    "manifest_to_tag",
    "rank_shards",
    "latest_tag",
    "list_tags",
    "merge_zero1",
    "open_tag",
    "parse_step",
    "read_tag",
    "shard_zero1",
    "tag_status",
    "write_tag",
]
