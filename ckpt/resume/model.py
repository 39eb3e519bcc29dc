"""The in-memory run that every source (JSONL ledger, TensorBoard, CSV, HF ``trainer_state.json``) produces.

Readers differ only in how they find sessions and values; the verifier, the report, the plot and the cost
report all work on this one shape, so a check written once works on every log format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Precision = Literal["float64", "float32", "rounded"]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One optimizer step as logged: ``step`` is the number of optimizer updates completed *including* this one.

    ``loss`` is the loss computed at this step (before its update), ``lr`` the learning rate its update used.
    Digests are opaque strings compared for equality only.

    ``epoch`` (fractional, as the HF Trainer and Lightning log it), ``samples`` and ``tokens`` are *position*
    fields: where in the data the run stands after this step, which a resume must continue
    (:mod:`ckpt.resume.checks.position`).  ``phase`` is the logged curriculum / data-mix state as one string
    (``"data/hard_fraction=0.5, data/phase=2"``): a change of it is a *scheduled* change, which the loss and
    LR checks do not take for a defect.
    """

    step: int
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    samples: int | None = None
    tokens: int | None = None
    data_digest: str | None = None
    rng_digest: str | None = None
    time: float | None = None
    epoch: float | None = None
    phase: str | None = None


@dataclass(frozen=True, slots=True)
class SessionStart:
    """A process began training; ``env`` holds versions, hostname, world size, determinism flags, tokenizer."""

    time: float | None
    env: dict[str, object]


@dataclass(frozen=True, slots=True)
class Restore:
    """State was loaded from the checkpoint of ``step`` at ``path``; ``inferred`` when a reader guessed it.

    ``model_digest``: the model's digest right after the restore (name -> digest), when the writer logged one, and
    ``model_views`` what each was taken over (:func:`ckpt.converters.digest.tensor_view`); ``unloaded``: checkpoint
    tensors the restore did not load and ``unfilled``: model tensors it left as they were (a ``strict=False`` load
    whose names did not match).
    ``optimizer_step`` is the live optimizer's update counter read right after the restore (``None`` when not
    logged): equal to ``step``, it proves the optimizer state was loaded, so a loss jump is not blamed on it.
    """

    time: float | None
    step: int
    path: str | None = None
    seconds: float | None = None
    inferred: bool = False
    model_digest: dict[str, str] | None = None
    optimizer_step: int | None = None
    model_views: dict[str, str] | None = None
    unloaded: tuple[str, ...] = ()
    unfilled: tuple[str, ...] = ()
    tier: str | None = None  # local / peer / persistent (ckpt.tiers); None: not logged
    #: the live optimizer after the load (``hyper``: settings per param group; ``exp_avg_norm``), when logged
    optimizer: dict[str, object] | None = None
    #: LRs of steps N+1, N+2, ... replayed from the checkpoint's scheduler state, when logged
    scheduled_lr: tuple[float, ...] = ()
    #: the live RNG right after the restore, per stream (:func:`ckpt.state.save_facts.rng_digests`), when logged
    rng_digests: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Save:
    """A checkpoint of ``step`` was committed; training was blocked ``blocking_seconds`` of ``total_seconds``."""

    time: float | None
    step: int
    path: str | None = None
    blocking_seconds: float | None = None
    total_seconds: float | None = None
    bytes: int | None = None
    #: save-time facts (:mod:`ckpt.state.save_facts`): the RNG state the checkpoint captured, per stream, and the
    #: fingerprint of the live weights when the save was requested; None when not logged (older ledgers)
    rng_digests: dict[str, str] | None = None
    weights_sample: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Compile:
    """A (re)compilation took ``seconds`` (Neuron / XLA graph compile, torch.compile)."""

    time: float | None
    seconds: float
    what: str | None = None


@dataclass(frozen=True, slots=True)
class Exit:
    """The process ended on its own (``clean``) rather than being killed."""

    time: float | None
    clean: bool = True


Event = SessionStart | Restore | Save | Compile | Exit


@dataclass(slots=True)
class Session:
    """One process lifetime: its steps in logged order and its events.

    ``event_positions[i]`` is the number of step records logged before ``events[i]``, which is what places a
    restore that happens mid-session (an in-process retry) between the right steps.
    """

    id: str
    steps: list[StepRecord] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    event_positions: list[int] = field(default_factory=list)
    origin: str = ""

    def add_event(self, event: Event) -> None:
        self.events.append(event)
        self.event_positions.append(len(self.steps))

    @property
    def start(self) -> SessionStart | None:
        return next((e for e in self.events if isinstance(e, SessionStart)), None)

    @property
    def env(self) -> dict[str, object]:
        start = self.start
        return start.env if start is not None else {}

    @property
    def saves(self) -> list[Save]:
        return [e for e in self.events if isinstance(e, Save)]

    @property
    def restores(self) -> list[Restore]:
        return [e for e in self.events if isinstance(e, Restore)]

    @property
    def compiles(self) -> list[Compile]:
        return [e for e in self.events if isinstance(e, Compile)]

    @property
    def exit(self) -> Exit | None:
        return next((e for e in self.events if isinstance(e, Exit)), None)

    @property
    def first_time(self) -> float | None:
        times = [t for t in (self.steps[0].time if self.steps else None, *(e.time for e in self.events)) if t]
        return min(times) if times else None

    @property
    def last_time(self) -> float | None:
        times = [
            t for t in (self.steps[-1].time if self.steps else None, *(e.time for e in self.events)) if t
        ]
        return max(times) if times else None


@dataclass(slots=True)
class Run:
    """All sessions of one training run, oldest first.

    ``precision`` says how values were stored: ``float64`` (exact Python floats), ``float32`` (TensorBoard
    scalars) or ``rounded`` (e.g. HF rounds the logged loss to 4 decimals); comparisons against values computed
    outside the log (a replayed schedule) are made at that precision.  ``notes`` records what a reader repaired
    or guessed (a torn last line, an inferred restore) so the report can say so.
    """

    path: str
    source: str
    sessions: list[Session] = field(default_factory=list)
    precision: Precision = "float64"
    notes: list[str] = field(default_factory=list)
    sessions_logged: bool = True
    """False when the log cannot show where a process started (HF ``trainer_state.json``, a CSV without a
    ``session`` column): a resume that logged nothing twice is then invisible, so the verifier also looks for
    discontinuities at the run's checkpoints (:func:`ckpt.resume.boundaries.suspected_boundaries`)."""

    @property
    def num_steps(self) -> int:
        return sum(len(s.steps) for s in self.sessions)
