"""The NxD tags of a run (``<checkpoint_dir>/step_N/``) for the weights check: model digests, no counters.

NxD's training loop has no ckpt manager, so its tags give the verifier what the files hold: the model weights of
each tag, digested in the tag's own rank layout (:func:`ckpt.converters.digest.source_digest`, no model config
needed).  That is enough to name a tag that holds an earlier tag's weights.  The counters check gets no facts from a
tag (``__call__`` returns None): NxD keeps them in pickles (``user_content.pt``, ``scheduler.pt``) this provider
does not read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckpt.resume.facts import CheckpointFacts, folder_digest


def holds_tags(root: str | os.PathLike[str]) -> bool:
    """True when ``root`` holds NxD tags (folders with ``model/`` rank files or NxD's marker files)."""
    from ckpt.converters.nxd.discovery import list_tags
    from ckpt.errors import CkptError

    try:
        return bool(list_tags(root))
    except CkptError:
        return False


class NxdTagCheckpoints:
    """A :data:`ckpt.resume.facts.FactsProvider` over the NxD tags under ``root`` that gives model digests only."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.notes: list[str] = []
        self._digests: dict[Path, Any] = {}
        self._views: dict[Path, Any] = {}

    def __call__(self, step: int, path: str | None) -> CheckpointFacts | None:
        return None

    def checkpoints(self) -> list[tuple[int, str]]:
        """(step, tag folder) of every complete or unmarked tag with a step in its name, oldest first."""
        from ckpt.converters.nxd.discovery import TagStatus, list_tags

        return [
            (t.step, str(t.path))
            for t in list_tags(self.root)
            if t.step is not None and t.status in (TagStatus.COMPLETE, TagStatus.UNMARKED)
        ]

    def digest(self, step: int, path: str | None) -> Any:
        """The model digest of the tag of ``step`` (cached); None when there is none or it cannot be read."""
        return folder_digest(self._candidates(step, path), self._digests, self.notes, allow_unmarked=True)

    def view_digest(self, step: int, path: str | None) -> Any:
        """The tag's model digest through the conversion engine's full HF-named view (what a live model restored
        through a layout conversion compares with; one read, cached); None when the engine cannot present it."""
        cands = self._candidates(step, path)
        return folder_digest(cands, self._views, self.notes, allow_unmarked=True, full_view=True)

    def _candidates(self, step: int, path: str | None) -> list[Path]:
        cands = [Path(path), self.root / Path(path).name] if path else []
        return cands + [Path(p) for s, p in self.checkpoints() if s == step]
