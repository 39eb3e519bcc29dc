"""The run directory and its ledger: what a training loop writes so that a resume can be verified later.

Layout (see ``docs/run-dir.md``)::

    <run>/ledger.jsonl      one JSON object per line: a ``step`` record per optimizer step, plus events
    <run>/checkpoints/      written by the checkpoint manager, never by this module

Why JSONL and one ``os.write`` per line: a job killed with SIGKILL mid-step must leave a file whose every line
is complete, so the pre-crash steps (the free A/B against the resumed session) survive.  The file is opened
``O_APPEND`` so a resumed process (and its session) continues the same file.  Floats are written with
Python's shortest round-trip repr, so a value read back is bit-identical to the one logged.

Only one process per run should write (rank 0); pass ``enabled=False`` on the other ranks so the same call
sites work everywhere.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from ckpt.resume.errors import LedgerWriteError

LEDGER_NAME = "ledger.jsonl"
CHECKPOINTS_DIR = "checkpoints"
SCHEMA_VERSION = 1

_VERSIONED_PACKAGES = (
    "torch",
    "torch-xla",
    "torch-neuronx",
    "neuronx-cc",
    "neuronx-distributed",
    "libneuronxla",
)


def ledger_path(run_dir: str | os.PathLike[str]) -> Path:
    """Where the ledger of ``run_dir`` lives (the one place that spells the file name)."""
    return Path(run_dir) / LEDGER_NAME


def checkpoints_dir(run_dir: str | os.PathLike[str]) -> Path:
    """Where the checkpoint manager writes this run's checkpoints."""
    return Path(run_dir) / CHECKPOINTS_DIR


def new_session_id() -> str:
    """A fresh id for this process's session: sortable by start time, unique across hosts and restarts."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def collect_env(
    *,
    world_size: int | None = None,
    deterministic: bool | None = None,
    tokenizer_id: str | None = None,
    seed: int | None = None,
    extra: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """What a session records about its environment, so drift between sessions can be named.

    Package versions come from installed metadata (importing torch_xla just to read its version would start
    the runtime).  ``deterministic`` is the run's own claim that it is bitwise reproducible; the verifier
    compares losses bit for bit only when every session makes it.
    """
    env: dict[str, object] = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "pid": os.getpid(),
    }
    for dist in _VERSIONED_PACKAGES:
        try:
            env[dist.replace("-", "_")] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        env["cuda"] = getattr(torch.version, "cuda", None)
        env["torch_deterministic_algorithms"] = bool(torch.are_deterministic_algorithms_enabled())
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        # Evidence of the device the run uses (nccl: CUDA, gloo: CPU, xla: torch-xla); ``cuda`` above is only
        # the CUDA version torch was built with, present whether or not a GPU is used.
        env["dist_backend"] = str(dist.get_backend())
    if world_size is None and os.environ.get("WORLD_SIZE", "").isdigit():
        world_size = int(os.environ["WORLD_SIZE"])
    env["world_size"] = world_size
    env["deterministic"] = deterministic
    if tokenizer_id is not None:
        env["tokenizer_id"] = tokenizer_id
    if seed is not None:
        env["seed"] = seed
    if extra:
        env.update(extra)
    return env


def tokenizer_id(tokenizer: Any) -> str:
    """``name@sha256[:16]`` of a tokenizer object or folder: log it as ``LedgerWriter(tokenizer_id=...)``.

    It is the format the verifier derives from a checkpoint's stored tokenizer identity, so a resume with a
    different tokenizer than the checkpoint was trained with is caught by file hash, whatever its name.
    """
    from ckpt.resume.manifest_facts import tokenizer_id_of
    from ckpt.state.tokenizer import identity

    tid = tokenizer_id_of(identity(tokenizer))
    assert tid is not None  # identity() always returns a sha256
    return tid


def _num(value: Any) -> float | None:
    """Plain Python float of a float / 0-d tensor / NumPy scalar, never rounded."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


class LedgerWriter:
    """Append-only writer of ``<run>/ledger.jsonl`` for one session (one process).

    Creating it writes ``session_start``; ``close()`` (or leaving the ``with`` block) writes ``exit`` with
    ``clean`` false when an exception is propagating.  Step records are written one ``os.write`` per line
    when ``buffer_lines`` is 1 (default); a larger value batches lines into one write, trading up to
    ``buffer_lines - 1`` steps on SIGKILL for fewer syscalls.  Events flush the buffer and ``fsync``, because
    save/restore events are what the verifier trusts most.

    Example::

        with LedgerWriter(run_dir, world_size=8, deterministic=True, enabled=rank == 0) as ledger:
            ledger.restore(step=n, path=ckpt_path, seconds=t)
            for step in range(n + 1, total + 1):
                ledger.step(step, loss, lr, data_digest=digest_ids(batch_ids), rng_digest=digest_rng())
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        world_size: int | None = None,
        deterministic: bool | None = None,
        tokenizer_id: str | None = None,
        seed: int | None = None,
        extra_env: Mapping[str, object] | None = None,
        session_id: str | None = None,
        buffer_lines: int = 1,
        enabled: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.session = session_id or new_session_id()
        self.path = ledger_path(run_dir)
        self.enabled = enabled
        self._clock = clock
        self._buffer: list[bytes] = []
        self._buffer_lines = max(1, int(buffer_lines))
        self._fd: int | None = None
        # The manager reports async-save commits from its writer thread while the loop logs steps.
        self._lock = threading.Lock()
        if not enabled:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._repair_torn_tail()
        except OSError as exc:
            raise LedgerWriteError(f"cannot open ledger {self.path}: {exc.strerror}") from None
        env = collect_env(
            world_size=world_size,
            deterministic=deterministic,
            tokenizer_id=tokenizer_id,
            seed=seed,
            extra=extra_env,
        )
        self._event("session_start", schema=SCHEMA_VERSION, env=env)

    def _repair_torn_tail(self) -> None:
        # A previous process killed mid-write (power loss) may have left a line without "\n"; end it so our
        # first line is not glued onto it.  The reader then skips that one torn line with a note.
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size:
            with open(self.path, "rb") as fh:
                fh.seek(size - 1)
                if fh.read(1) != b"\n":
                    os.write(self._fd, b"\n")

    # -- records ---------------------------------------------------------------------------------------
    def step(
        self,
        step: int,
        loss: Any,
        lr: Any,
        *,
        grad_norm: Any = None,
        samples: int | None = None,
        tokens: int | None = None,
        data_digest: str | None = None,
        rng_digest: str | None = None,
        epoch: float | None = None,
        phase: Mapping[str, object] | None = None,
    ) -> None:
        """Record optimizer step ``step`` (1-based count of updates including this one).

        ``loss`` is the loss computed at this step, ``lr`` the rate its update used (read it before
        ``scheduler.step()``), ``samples``/``tokens`` the totals consumed after this step.  Tensors are
        converted with ``.item()`` (a host sync the loop usually pays for logging anyway).  ``epoch`` is the
        fractional epoch after this step (a position, like ``samples``); ``phase`` the curriculum / data-mix
        state the step trained under (``{"data/phase": 2}``): a change of it is scheduled, not a defect.
        """
        if not self.enabled:
            return
        rec: dict[str, object] = {"kind": "step", "step": int(step), "loss": _num(loss), "lr": _num(lr)}
        if grad_norm is not None:
            rec["grad_norm"] = _num(grad_norm)
        if samples is not None:
            rec["samples"] = int(samples)
        if tokens is not None:
            rec["tokens"] = int(tokens)
        if data_digest is not None:
            rec["data_digest"] = data_digest
        if rng_digest is not None:
            rec["rng_digest"] = rng_digest
        if epoch is not None:
            rec["epoch"] = float(epoch)
        if phase:
            rec["phase"] = {str(k): _num(v) if not isinstance(v, str) else v for k, v in phase.items()}
        rec["time"] = self._clock()
        rec["session"] = self.session
        with self._lock:
            self._buffer.append(_line(rec))
            if len(self._buffer) >= self._buffer_lines:
                self._flush_locked(sync=False)

    def restore(
        self,
        step: int,
        path: str | os.PathLike[str] | None,
        seconds: float | None = None,
        *,
        model_digest: Mapping[str, str] | None = None,
        optimizer_step: int | None = None,
        model_views: Mapping[str, str] | None = None,
        unloaded: Iterable[str] = (),
        unfilled: Iterable[str] = (),
        tier: str | None = None,
        optimizer: Mapping[str, object] | None = None,
        scheduled_lr: Iterable[float] | None = None,
        rng_digests: Mapping[str, str] | None = None,
    ) -> None:
        """Record that state of step ``step`` was loaded from ``path`` in ``seconds``; log it before training.

        ``tier``: where it came from (``local``, ``peer``, ``persistent``: :mod:`ckpt.tiers`), so that ``ckpt report``
        prices recovery per tier.

        ``model_digest`` and ``model_views`` (optional, ``ckpt.converters.digest.live_digest`` of the model right
        after the restore: each tensor's digest and the view it was taken in) let the verifier name weights that
        were not restored; without the views the digests are not compared.  ``unloaded`` / ``unfilled``: the
        checkpoint's tensors the restore did not load and the model's it left as they were (``strict=False``).
        ``optimizer_step`` (optional, :func:`optimizer_step`) is the live optimizer's update counter after the
        load: the verifier then knows the optimizer state arrived and does not blame a loss jump on it.
        ``optimizer`` (:func:`ckpt.resume.restore_facts.optimizer_summary`) is the live optimizer's hyperparameters per param group and
        the norm of its first moments after the load, compared with the checkpoint's (betas or weight decay
        changed, moments zeroed with the step kept).  ``scheduled_lr`` is the LRs of steps N+1, N+2, ... that
        the checkpoint's scheduler state gives when replayed (:func:`ckpt.resume.restore_facts.replay_scheduler`),
        so that a warm restart or a milestone at the boundary is expected, not a jump.  ``rng_digests``
        (:func:`ckpt.state.save_facts.rng_digests` right after the restore) is compared with the save event's.
        """
        fields: dict[str, object] = {
            "step": int(step),
            "path": None if path is None else str(path),
            "seconds": seconds,
        }
        if model_digest is not None:
            fields["model_digest"] = dict(model_digest)
        if optimizer_step is not None:
            fields["optimizer_step"] = int(optimizer_step)
        if model_views is not None:
            fields["model_views"] = dict(model_views)
        if tier is not None:
            fields["tier"] = str(tier)
        if optimizer is not None:
            fields["optimizer"] = dict(optimizer)
        if scheduled_lr is not None:
            fields["scheduled_lr"] = [float(v) for v in scheduled_lr]
        if rng_digests is not None:
            fields["rng_digests"] = dict(rng_digests)
        for key, names in (("unloaded", list(unloaded)), ("unfilled", list(unfilled))):
            if names:
                fields[key] = [str(n) for n in names]
        self._event("restore", **fields)

    def save(
        self,
        step: int,
        path: str | os.PathLike[str] | None,
        blocking_seconds: float | None = None,
        total_seconds: float | None = None,
        bytes: int | None = None,  # noqa: A002 - the ledger field's name
        *,
        rng_digests: Mapping[str, str] | None = None,
        weights_sample: Mapping[str, str] | None = None,
        facts_seconds: float | None = None,
    ) -> None:
        """Record a *committed* checkpoint of ``step``; log it when the commit is durable, not when it starts.

        The save-time facts (:mod:`ckpt.state.save_facts`, taken when the save was requested, ``facts_seconds``
        their cost): ``rng_digests``, the RNG state the checkpoint captured, and ``weights_sample``, the fingerprint
        of the live weights; a resume is then judged on them where no step overlaps."""
        fields: dict[str, object] = {
            "step": int(step),
            "path": None if path is None else str(path),
            "blocking_seconds": blocking_seconds,
            "total_seconds": total_seconds,
        }
        if bytes is not None:
            fields["bytes"] = int(bytes)
        for key, value in (("rng_digests", rng_digests), ("weights_sample", weights_sample)):
            if value is not None:
                fields[key] = dict(value)
        if facts_seconds is not None:
            fields["facts_seconds"] = float(facts_seconds)
        self._event("save", **fields)

    def on_event(self, kind: str, info: Mapping[str, Any]) -> None:
        """Adapter for ``CheckpointManager(on_event=ledger.on_event)``: the manager's own save/restore events.

        Why here and not in the manager: the manager stays free of ledger code and emits plain dicts
        (``save``: step, path, blocking_s, total_s, bytes, rng_digests, weights_sample, facts_s; ``restore``: step,
        path, seconds, model_digest, model_views, unloaded, unfilled, tier, rng_digests); this maps them
        to ledger events.  Saves arrive on the async writer thread once committed, which is exactly when the
        ledger wants them.  Unknown kinds are ignored so a newer manager cannot break an older ledger.
        """
        if kind == "save":
            self.save(
                int(info["step"]),
                info.get("path"),
                blocking_seconds=info.get("blocking_s"),
                total_seconds=info.get("total_s"),
                bytes=info.get("bytes"),
                rng_digests=info.get("rng_digests"),
                weights_sample=info.get("weights_sample"),
                facts_seconds=info.get("facts_s"),
            )
        elif kind == "restore":
            self.restore(
                int(info["step"]),
                info.get("path"),
                seconds=info.get("seconds"),
                model_digest=info.get("model_digest"),
                model_views=info.get("model_views"),
                unloaded=info.get("unloaded") or (),
                unfilled=info.get("unfilled") or (),
                tier=info.get("tier"),
                rng_digests=info.get("rng_digests"),
            )

    def compile(self, seconds: float, what: str | None = None) -> None:
        """Record a graph compilation of ``seconds`` (what: e.g. ``"neuron train graph"``)."""
        self._event("compile", seconds=float(seconds), what=what)

    def close(self, clean: bool = True) -> None:
        """Write ``exit`` and close; idempotent.  ``clean`` false marks a session that ended on an error."""
        if self._fd is None:
            return
        self._event("exit", clean=bool(clean))
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> LedgerWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(clean=exc_type is None)

    # -- plumbing --------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: object) -> None:
        if not self.enabled:
            return
        rec: dict[str, object] = {"kind": kind, **fields, "time": self._clock(), "session": self.session}
        with self._lock:
            self._buffer.append(_line(rec))
            self._flush_locked(sync=True)

    def flush(self, sync: bool = False) -> None:
        """Write buffered lines with one ``os.write`` (whole lines only); ``sync`` also fsyncs."""
        with self._lock:
            self._flush_locked(sync)

    def _flush_locked(self, sync: bool) -> None:
        if self._fd is None:
            if self.enabled and self._buffer:
                raise LedgerWriteError(f"ledger {self.path} is closed")
            return
        if self._buffer:
            data = b"".join(self._buffer)
            self._buffer.clear()
            try:
                while data:
                    written = os.write(self._fd, data)
                    data = data[written:]
            except OSError as exc:
                raise LedgerWriteError(f"cannot write ledger {self.path}: {exc.strerror}") from None
        if sync:
            os.fsync(self._fd)


def _line(rec: Mapping[str, object]) -> bytes:
    # json.dumps writes floats with repr(): the shortest string that reads back to the same double.
    return (json.dumps(rec, separators=(",", ":")) + "\n").encode()


def optimizer_step(optimizer: Any) -> int | None:
    """The update counter of a live torch optimizer (the largest per-parameter ``step``; Adam, AdamW and
    friends keep one; 0 for an Adam-family optimizer with no state yet), or None when it keeps none.  Log it with the restore event: equal to N after restoring
    checkpoint N, it proves the optimizer state was loaded."""
    state = getattr(optimizer, "state", {})
    steps = [int(_num(st["step"]) or 0) for st in state.values() if isinstance(st, Mapping) and "step" in st]
    if steps:
        return max(steps)
    # Adam-family optimizers (``betas``) keep a counter from their first update on: none at all means a
    # fresh optimizer, 0 updates.  Others (plain SGD) keep none, so nothing can be said.
    groups = getattr(optimizer, "param_groups", [])
    return 0 if not state and any("betas" in g for g in groups) else None


def digest_ids(sample_ids: Iterable[Any] | Any) -> str:
    """Stable 16-hex-digit hash of a batch's sample ids, order included.

    Integers hash as little-endian int64 whatever their container (list, NumPy array, CPU tensor), so the
    same batch gives the same digest in every session; anything else hashes by its ``str``.  Two sessions
    that consumed the same batch at the same step log the same digest; a lost data position does not.
    """
    import numpy as np

    if hasattr(sample_ids, "detach"):
        sample_ids = sample_ids.detach().cpu().numpy()
    arr = np.asarray(list(sample_ids) if not hasattr(sample_ids, "__array__") else sample_ids)
    h = hashlib.blake2b(digest_size=8)
    if arr.dtype.kind in "iub":
        h.update(repr(arr.shape).encode())
        h.update(np.ascontiguousarray(arr, dtype="<i8").tobytes())
    else:
        h.update(json.dumps([str(x) for x in arr.ravel().tolist()]).encode())
    return h.hexdigest()


def digest_rng() -> str:
    """Hash of every RNG stream a training step may draw from: Python, NumPy global, torch CPU, torch CUDA
    (all devices, only when CUDA is already initialised, so calling this never initialises it) and the XLA
    seed when torch_xla is already imported.  Log it at the same point of every step (e.g. before forward):
    equal digests at the same step in two sessions mean the RNG state was restored.
    """
    import random

    import numpy as np

    h = hashlib.blake2b(digest_size=8)
    h.update(repr(random.getstate()).encode())
    name, keys, pos, has_gauss, cached = np.random.get_state()
    h.update(np.asarray(keys).tobytes())
    h.update(repr((name, int(pos), int(has_gauss), float(cached))).encode())
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        h.update(torch.get_rng_state().numpy().tobytes())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for state in torch.cuda.get_rng_state_all():
                h.update(state.numpy().tobytes())
    if "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        h.update(repr(xm.get_rng_state()).encode())
    return h.hexdigest()
