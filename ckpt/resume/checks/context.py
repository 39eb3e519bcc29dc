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
    With overlap (the same steps logged before the crash and after the resume, on the same batches) the
    paired differences are tested: their mean must stay within ``paired_floor`` (relative to the loss) or
    within ``paired_t`` standard errors of the differences' own spread, which is the run's nondeterminism,
    not its batch noise.  Without overlap the median of the first ``level_window`` post-resume losses is
    compared with a robust linear trend (Theil-Sen) of the last ``noise_window`` pre-boundary steps, held at
    its value at N+1, in standard errors (``level_z``); a single step above ``spike_z`` times the batch noise
    is a spike in either case.
    """

    deterministic: bool | None = None
    noise_window: int = 30
    spike_window: int = 10
    level_z: float = 4.0
    level_window: int = 20
    spike_z: float = 12.0
    paired_floor: float = 0.005
    paired_t: float = 3.0
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
