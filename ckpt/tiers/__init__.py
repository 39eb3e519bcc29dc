"""Checkpoint tiers: a node-local tier (local disk or ``/dev/shm``) with replicas on peer nodes, in front of the
persistent root (an object store or a shared filesystem).

``CheckpointManager(root, local_dir=..., local_every=..., persist_every=..., replicas=..., keep_local=...)`` uses
:class:`~ckpt.tiers.tiered.Tiers`; each module has one job:

* :mod:`.policy`: which tiers a step goes to;
* :mod:`.node`: which node each rank is on, and which ranks hold its replicas;
* :mod:`.files`: a local step's files and their verification against its manifest;
* :mod:`.transfer`: moving files between ranks over the tier's gloo group, copying none of them on the host;
* :mod:`.outgoing`: one file to send, mapped (gloo reads it where it lies);
* :mod:`.landing`: one received file, written by gloo into a temp file beside its name, renamed once confirmed;
* :mod:`.replicate`: the background half of a local save (replicas, commit, persistent copy);
* :mod:`.agree`: which step every rank restores, and from where;
* :mod:`.retention`: what the local tier keeps;
* :mod:`.memory`: the host-memory tier (``local_memory=True``): the save's arena is the data file, in /dev/shm;
* :mod:`.runid`: which run a local step belongs to (a restore takes only this run's).
"""

from .node import NodeMap
from .policy import TierPolicy

__all__ = ["NodeMap", "TierPolicy"]
