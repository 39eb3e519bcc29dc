"""File and tag names NxD uses on disk, parsed and formatted in one place.

Names verified against neuronx-distributed 0.18.0 (``trainer/checkpoint.py::_get_path``,
``parallel_layers/checkpointing.py::save``):

* training checkpoints: ``dp_rank_DD[_ep_rank_EE]_tp_rank_TT_pp_rank_PP.pt`` (``model/`` always has dp 00;
  ``optim/`` has one file per DP rank with ZeRO-1, and an ep field only without ZeRO-1);
* legacy ``parallel_layers.checkpointing.save``: ``tp_rank_TT_pp_rank_PP[_dp_rank_DD]`` which is a folder holding
  ``checkpoint.pt`` (plain) or a ref file next to ``<name>.tensors/`` (xser).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

RankKey = tuple[int, int, int]
"""(tp, pp, ep) of one model-parallel rank; ep is 0 without expert parallelism."""

_RANK_FILE = re.compile(r"^dp_rank_(\d+)(?:_ep_rank_(\d+))?_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
_LEGACY = re.compile(r"^tp_rank_(\d+)_pp_rank_(\d+)(?:_dp_rank_(\d+))?$")
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")


@dataclass(frozen=True)
class RankFile:
    """The ranks encoded in one NxD file name (``ep`` is None when the name has no ep field)."""

    dp: int
    tp: int
    pp: int
    ep: int | None = None

    @property
    def key(self) -> RankKey:
        return (self.tp, self.pp, self.ep or 0)


def parse_rank_file(name: str) -> RankFile | None:
    """Parse ``dp_rank_DD[_ep_rank_EE]_tp_rank_TT_pp_rank_PP.pt``; None for any other name."""
    m = _RANK_FILE.match(name)
    if not m:
        return None
    dp, ep, tp, pp = m.groups()
    return RankFile(dp=int(dp), tp=int(tp), pp=int(pp), ep=None if ep is None else int(ep))


def rank_file_name(dp: int, tp: int, pp: int, ep: int | None = None) -> str:
    """Inverse of :func:`parse_rank_file` (two-digit fields, as NxD writes them)."""
    ep_part = "" if ep is None else f"_ep_rank_{ep:02d}"
    return f"dp_rank_{dp:02d}{ep_part}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def parse_legacy_name(name: str) -> RankFile | None:
    """Parse the legacy ``tp_rank_TT_pp_rank_PP[_dp_rank_DD]`` entry name; None for any other name."""
    m = _LEGACY.match(name)
    if not m:
        return None
    tp, pp, dp = m.groups()
    return RankFile(dp=int(dp or 0), tp=int(tp), pp=int(pp))


def parse_step(tag: str) -> int | None:
    """The step a tag stands for: its last run of digits (``step_120`` -> 120); None if it has no digits.

    NxD itself orders tags by marker-file mtime, which copying or syncing a directory silently changes; the number in
    the tag (NxD's examples use ``step_<N>``) is what the user meant.
    """
    m = _LAST_NUMBER.search(tag)
    return int(m.group(1)) if m else None


#: what a training tag holds beside ``model/``, and what the user loses by pointing at ``model/`` alone
_TAG_PARTS = {
    "optim": "the optimizer state (optim/)",
    "scheduler.pt": "the scheduler (scheduler.pt)",
    "user_content.pt": "the step and user state (user_content.pt)",
    "done": "the 'done' marker",
    "checkpoint": "the 'checkpoint' marker",
}


def part_of_tag(path: str | Path) -> str | None:
    """When ``path`` is the ``model/`` or ``optim/`` folder of an NxD training tag, the one line saying so and what
    the rest of the tag holds (a conversion or inspection of the part alone would silently lose it); else None.

    Reads listings only (no torch), so the CLI can say it before importing the reader.
    """
    p = Path(path)
    if p.name not in ("model", "optim") or not p.is_dir():
        return None
    tag = p.parent
    if not (tag / "model").is_dir() or not any(parse_rank_file(c.name) for c in (tag / "model").iterdir()):
        return None
    beside = [what for name, what in _TAG_PARTS.items() if name != p.name and (tag / name).exists()]
    if p.name == "model" and not beside:
        return None  # converter output: model/ is the whole tag
    also = f", which also holds {', '.join(beside)}" if beside else ""
    return f"{path} is the {p.name}/ folder of the NxD tag {tag}{also}; point at the whole tag: {tag}"
