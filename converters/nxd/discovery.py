"""Find the tags under an NxD checkpoint directory and say honestly what state each is in.

NxD (``checkpoint_storage.list_completed_checkpoint_tags``) trusts only ``<tag>/done`` and orders tags by the
marker's mtime.  Two things go wrong with that: copying a directory without preserving mtimes reorders tags, and
an async save that crashed after writing every file but before ``done`` (NxD writes ``done`` of tag N only when
the next save starts or at ``finalize_checkpoint``) leaves a fully usable tag that auto-resume silently skips.  We
order by the step number in the tag name and report such a tag as ``unmarked`` instead of hiding it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from ckpt.errors import CkptError

from .files import find_problems, scan_tag
from .naming import parse_step


class TagStatus(str, enum.Enum):
    COMPLETE = "complete"
    """``done`` exists and every expected file is present: NxD considers it loadable, and it is."""
    DAMAGED = "damaged"
    """``done`` exists (NxD would load it) but files are missing or truncated: damage after the save."""
    INCOMPLETE = "incomplete"
    """no ``done`` and files are missing or truncated: a save that did not finish."""
    UNMARKED = "unmarked"
    """no ``done`` but every expected file is present (async save that crashed before marking, or converter output)."""


@dataclass(frozen=True)
class TagInfo:
    """One tag: its name, the step parsed from the name (None if it has no digits), status and found problems."""

    name: str
    path: Path
    step: int | None
    status: TagStatus
    problems: tuple[str, ...] = ()


def tag_status(tag_dir: str | Path) -> TagInfo:
    """Status of one tag directory.  ``problems`` lists missing/truncated files even when ``done`` exists."""
    tag_dir = Path(tag_dir).absolute()
    try:
        files = scan_tag(tag_dir)
    except CkptError as e:
        return TagInfo(tag_dir.name, tag_dir, parse_step(tag_dir.name), TagStatus.INCOMPLETE, (str(e),))
    problems = tuple(find_problems(files))
    if files.has_done:
        status = TagStatus.DAMAGED if problems else TagStatus.COMPLETE
    elif problems:
        status = TagStatus.INCOMPLETE
    else:
        status = TagStatus.UNMARKED
    return TagInfo(tag_dir.name, tag_dir, parse_step(tag_dir.name), status, problems)


def _looks_like_tag(d: Path) -> bool:
    return (
        (d / "checkpoint").is_file()
        or (d / "done").is_file()
        or (d / "model").is_dir()
        or (d / "optim").is_dir()
    )


def list_tags(root: str | Path) -> list[TagInfo]:
    """All tags directly under ``root``, ordered by step (tags without a number last, by name).

    Temporary folders of our own writer (names starting with ``.``) are skipped.
    """
    root = Path(root)
    if not root.is_dir():
        raise CkptError(f"{root}: not a directory")
    tags = [
        tag_status(d)
        for d in root.iterdir()
        if d.is_dir() and not d.name.startswith(".") and _looks_like_tag(d)
    ]
    return sorted(tags, key=lambda t: (t.step is None, t.step if t.step is not None else 0, t.name))


def latest_tag(root: str | Path, *, allow_unmarked: bool = False) -> TagInfo | None:
    """The highest-step complete tag (or unmarked too, when asked); None when there is none."""
    ok = {TagStatus.COMPLETE} | ({TagStatus.UNMARKED} if allow_unmarked else set())
    usable = [t for t in list_tags(root) if t.status in ok]
    return usable[-1] if usable else None
