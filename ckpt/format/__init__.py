"""The on-disk format (spec: docs/format.md): the manifest, the per-rank index, data files, and the one publish point.

Everything that decides which bytes a checkpoint holds and how they are named lives here; the save path, the restore
path and the converters all go through it.
"""
