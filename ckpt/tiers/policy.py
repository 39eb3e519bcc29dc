"""Which tiers a step is saved to: the local tier every ``local_every`` steps, the persistent one every
``persist_every``."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CkptError

LOCAL = "local"
PEER = "peer"
PERSISTENT = "persistent"


@dataclass(frozen=True)
class TierPolicy:
    """``local_every`` / ``persist_every``: save steps divisible by it to that tier; None: every step ``save`` is
    called with (for the persistent tier without a local one: what ``CheckpointManager`` always did).  ``local``
    False: no local tier (no ``local_dir``)."""

    local: bool = False
    local_every: int | None = None
    persist_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("local_every", "persist_every"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise CkptError(f"{name}={v!r}: expected a positive integer (or None: every step saved)")
        if self.local_every is not None and not self.local:
            raise CkptError(f"local_every={self.local_every} needs local_dir= (the node-local tier's folder)")

    def tiers(self, step: int) -> tuple[str, ...]:
        """The tiers step ``step`` goes to (empty: ``save`` is a no-op for it)."""
        out = []
        if self.local and (self.local_every is None or step % self.local_every == 0):
            out.append(LOCAL)
        if self.persist_every is None or step % self.persist_every == 0:
            out.append(PERSISTENT)
        return tuple(out)
