"""What every check receives: the boundary plus the run-wide inputs (options, replayed LR, checkpoint facts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpt.resume.boundaries import Boundary
from ckpt.resume.facts import CheckpointFacts
from ckpt.resume.model import Run


@dataclass(frozen=True, slots=True)
class VerifyOptions:
    """Knobs of the tolerance-mode loss check; the exact checks have none.

    ``deterministic`` None means: trust the sessions' own ``deterministic`` flag (all must claim it).
    The noise is calibrated on the last ``noise_window`` pre-boundary steps only (local: a span that includes
    the steep early drop would hide real jumps); the first ``spike_window`` post-resume steps are tested for a
    level shift (median z above ``level_z``) or a spike (any z above ``spike_z``).  Without overlap the
    reference is a robust linear trend (Theil-Sen) of those steps, held at its value at N+1.
    """

    deterministic: bool | None = None
    noise_window: int = 30
    spike_window: int = 10
    level_z: float = 4.0
    spike_z: float = 12.0
    lr_pattern_steps: int = 20


@dataclass(frozen=True, slots=True)
class CheckContext:
    run: Run
    boundary: Boundary
    options: VerifyOptions
    deterministic: bool
    lr_reference: dict[int, float] | None = None
    facts: CheckpointFacts | None = None
    #: the run's checkpoints' model digests (``digest(step, path)``, ``checkpoints()``: the facts providers of
    #: :mod:`ckpt.resume.manifest_facts` and :mod:`ckpt.resume.hf_facts`), for the weights check
    weights: Any = None
