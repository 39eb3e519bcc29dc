"""NxD Training's tag name, ``<run>--step=<step>-consumed_samples=<samples>[-last].ckpt``: a documented record of the
step and the data position (its ``exp_manager`` ModelCheckpoint template; sources cited in fixtures/nxdt/README.md).

The one naming whose digits are read (``step.NAME_TEMPLATES``); any other name gives no step.  Its own module so that
the step reader and the NxD Training source share it without importing each other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckpt.errors import CkptError

_TEMPLATE = re.compile(
    r"^(?P<run>.+?)--step=(?P<step>\d+)-consumed_samples=(?P<samples>\d+(?:\.\d+)?)(?P<last>-last)?\.ckpt$"
)


@dataclass(frozen=True)
class TagName:
    """What an NxD Training tag name records: ``<run>--step=<step>-consumed_samples=<samples>[-last].ckpt``."""

    run: str
    step: int
    consumed_samples: int
    last: bool = False

    def __str__(self) -> str:
        # Lightning formats the logged float metric: 1280 -> "1280.0" (NxD Training's regex needs the ".")
        return (
            f"{self.run}--step={self.step}-consumed_samples={float(self.consumed_samples)}"
            f"{'-last' if self.last else ''}.ckpt"
        )


def parse_tag_name(name: str) -> TagName | None:
    """The step and data position an NxD Training tag name records; None for a name not of that template.

    Only the documented template is read (see the module docstring).  ``consumed_samples`` is written as a float
    (Lightning formats the logged metric); a fractional count is no sample count and is refused.
    """
    m = _TEMPLATE.match(name)
    if m is None:
        return None
    samples = float(m["samples"])
    if not samples.is_integer():
        raise CkptError(f"{name}: consumed_samples={m['samples']} is not a whole number of samples")
    return TagName(m["run"], int(m["step"]), int(samples), bool(m["last"]))


def name_step(name: str) -> int | None:
    """The step a tag name records under NxD Training's template, else None (never raises): a strict name parser
    for the NxD reader's step sources, which take no digits from an arbitrary name."""
    try:
        parsed = parse_tag_name(name)
    except CkptError:
        return None
    return parsed.step if parsed is not None else None


__all__ = ["TagName", "name_step", "parse_tag_name"]
