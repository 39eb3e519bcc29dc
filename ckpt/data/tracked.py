"""``ckpt.data.track(loader)``: a plain ``torch.utils.data.DataLoader`` made resumable.

A plain DataLoader keeps no position, and its sampler runs ahead of the training loop (workers prefetch), so the
only trustworthy count is of the batches the loop actually received: :class:`TrackedLoader` counts them as it
hands them out, and offers ``state_dict``/``load_state_dict`` so ``save(dataloader=...)`` records the position.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class TrackedLoader:
    """Iterates ``loader`` and counts the batches handed to the caller in the current iteration (epoch)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.batches = 0
        self.finished = False

    def __iter__(self) -> Iterator[Any]:
        self.batches = 0
        self.finished = False
        for batch in self.loader:
            self.batches += 1
            yield batch
        self.finished = True

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        # sampler, batch_size, dataset, ...: the wrapped loader's (only called for names not found here)
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "finished": self.finished}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Per-rank state only; the position itself is restored through the sampler (ckpt.data.restore)."""
        self.batches = int(state.get("batches", 0))
        self.finished = bool(state.get("finished", False))


def track(loader: Any) -> TrackedLoader:
    """Wrap a plain DataLoader (over a DistributedSampler) so that its position can be saved and restored.

    Iterate the returned object instead of the loader: ``for batch in tracked: ...``.
    """
    return TrackedLoader(loader)
