"""Fill :class:`CheckpointFacts` from ckpt manifests, so ``verify-resume run/`` checks ``run/checkpoints/``.

Only the manifest (one small JSON document) is read, never tensor data: the counters the verifier needs are
all in it.  Optimizer per-parameter ``step`` scalars and the scheduler state are stored through
:mod:`ckpt.format.treecodec`, so they are decoded here (a 0-d ``step`` tensor becomes an int).

The provider looks a checkpoint up by the restore event's path first (the manager logs the exact folder it
restored), then by step under the checkpoints root (``step_XXXXXXXX``); a checkpoint that retention has
since deleted, or that cannot be read, yields no facts and a note saying why, never an error: the log
checks still run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ckpt.resume.facts import CachedFacts, CheckpointFacts


def _as_int(value: Any) -> int | None:
    """A decoded counter (int, float, 0-d tensor or NumPy scalar) as an int, or None when it is not one."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def tokenizer_id_of(identity: Mapping[str, Any] | None) -> str | None:
    """``name@sha256[:16]`` of a tokenizer identity (``ckpt.state.tokenizer.identity``), the ledger's format too.

    Why one format: the session's ``tokenizer_id`` and the checkpoint's identity are compared as strings;
    log ``ckpt.resume.ledger.tokenizer_id(tokenizer)`` so the two agree.
    """
    if not identity or not identity.get("sha256"):
        return None
    return f"{identity.get('name') or 'tokenizer'}@{str(identity['sha256'])[:16]}"


def _env(environment: Mapping[str, Any]) -> dict[str, object]:
    """The manifest's environment in the ledger's keys (``torch_xla``, not ``torch-xla``) for drift checks."""
    env: dict[str, object] = {}
    versions = environment.get("versions") or {}
    if isinstance(versions, Mapping):
        env.update({str(k).replace("-", "_"): v for k, v in versions.items()})
    for key in ("python", "cuda", "world_size"):
        if environment.get(key) is not None:
            env[key] = environment[key]
    return env


def scheduler_position(sched: Any) -> tuple[int | None, float | None]:
    """(``last_epoch``, ``_last_lr[0]``) of a torch LR scheduler's state dict, None where absent."""
    if not isinstance(sched, Mapping):
        return None, None
    last_epoch = _as_int(sched["last_epoch"]) if "last_epoch" in sched else None
    if "patience" in sched and "num_bad_epochs" in sched:
        # ReduceLROnPlateau: stepped once per evaluation with a metric, so last_epoch counts evaluations,
        # not updates; it says nothing about the restored step
        last_epoch = None
    last_lr = sched.get("_last_lr")
    if isinstance(last_lr, (list, tuple)) and last_lr:
        last_lr = last_lr[0]
    if hasattr(last_lr, "item"):
        last_lr = last_lr.item()
    lr = float(last_lr) if isinstance(last_lr, (int, float)) and not isinstance(last_lr, bool) else None
    return last_epoch, lr


def facts_from_manifest(manifest: Any) -> CheckpointFacts:
    """Counters of one checkpoint from its :class:`ckpt.format.manifest.Manifest`."""
    from ckpt.format import treecodec

    opt_steps: dict[str, int] = {}
    state = (manifest.optimizer or {}).get("state") or {}
    for param, scalars in state.items():
        if isinstance(scalars, Mapping) and "step" in scalars:
            value = _as_int(treecodec.decode(scalars["step"]))
            if value is not None:
                opt_steps[str(param)] = value
    last_epoch = last_lr = None
    if manifest.scheduler is not None:
        sched = treecodec.decode(manifest.scheduler)
        last_epoch, last_lr = scheduler_position(sched)
    progress = manifest.progress or {}
    samples = _as_int(progress.get("samples")) if "samples" in progress else None
    base = getattr(manifest, "rng_base", None) or {}
    position = getattr(manifest, "data_position", None) or {}
    dp = position.get("dp") or base.get("dp")
    rng = manifest.rng or {}
    first = rng[min(rng, key=int)] if rng else None
    return CheckpointFacts(
        step=int(manifest.step),
        optimizer_steps=opt_steps or None,
        scheduler_last_epoch=last_epoch,
        scheduler_last_lr=last_lr,
        samples=samples,
        tokenizer_id=tokenizer_id_of(manifest.tokenizer),
        env=_env(manifest.environment or {}),
        dp=dp if isinstance(dp, int) else None,
        rng_shared=tuple(base["shared"]) if isinstance(base.get("shared"), list) else None,
        rng_streams=tuple(k for k in first if k != "xla_nxd_tracker_seeds")
        if isinstance(first, dict)
        else None,
    )


class ManifestFacts(CachedFacts):
    """A :data:`ckpt.resume.facts.FactsProvider` over the checkpoints under ``root`` (local path or URL).

    ``notes`` collects why a checkpoint gave no facts (deleted by retention, unreadable), for the report.
    """

    def __init__(self, root: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
        self.root = str(root).rstrip("/")
        self.storage_options = storage_options
        self.notes: list[str] = []
        super().__init__()
        self._digests: dict[str, Any] = {}
        self._views: dict[str, Any] = {}
        self._samples: dict[str, Any] = {}

    def checkpoints(self) -> list[tuple[int, str]]:
        """(step, path) of every committed checkpoint under the root, oldest first (for the weights check)."""
        from ckpt.errors import CkptError
        from ckpt.restoring.discovery import list_checkpoints

        try:
            infos = list_checkpoints(self.root, storage_options=self.storage_options)
        except (CkptError, OSError):
            return []
        return [(i.step, f"{self.root}/{i.name}") for i in infos if i.status == "committed"]

    def digest(self, step: int, path: str | None) -> Any:
        """The model digest (:class:`ckpt.converters.digest.CheckpointDigest`) of the checkpoint of ``step``, from
        its manifest's chunk checksums (no data read for ``raw`` chunks); None when it cannot be read."""
        from ckpt.converters.digest import manifest_digest
        from ckpt.errors import CkptError
        from ckpt.format.reader import CheckpointReader

        for cand in self._candidates(step, path):
            if cand in self._digests:
                return self._digests[cand]
            try:
                reader = CheckpointReader(cand, self.storage_options)
            except (CkptError, OSError):
                continue
            if int(reader.manifest.step) != step:
                continue
            found = self._digests[cand] = manifest_digest(reader)
            return found
        return None

    def sample(self, step: int, path: str | None) -> dict[str, str] | None:
        """The weight sample (:func:`ckpt.state.save_facts.manifest_sample`) of the checkpoint of ``step``, compared
        with the save event's fingerprint; None (and a note) when it cannot be read or is in another layout."""
        from ckpt.errors import CkptError
        from ckpt.state.save_facts import manifest_sample

        if self.digest(step, path) is None:
            return None
        cand = next(c for c in self._candidates(step, path) if self._digests.get(c) is not None)
        if cand not in self._samples:
            try:
                self._samples[cand] = manifest_sample(cand, self.storage_options)
            except (CkptError, OSError, ValueError) as exc:
                self.notes.append(f"{cand}: weights not readable for the save-time sample ({exc})")
                self._samples[cand] = None
        return self._samples[cand]

    def view_digest(self, step: int, path: str | None) -> Any:
        """The checkpoint's model digest through the conversion engine's full HF-named view (one read of the model,
        cached): what a live model compares with when the checkpoint's stored layout is not the model's (a Neuron
        layout, other chunks or dtypes); None (and a note) when the engine cannot present it in full."""
        from ckpt.converters.digest import source_digest
        from ckpt.errors import CkptError

        if self.digest(step, path) is None:
            return None
        cand = next(c for c in self._candidates(step, path) if self._digests.get(c) is not None)
        if cand not in self._views:
            try:
                self._views[cand] = source_digest(cand, full_view=True, storage_options=self.storage_options)
            except (CkptError, OSError, ValueError) as exc:
                self.notes.append(f"{cand}: weights not readable in the HF view ({exc})")
                self._views[cand] = None
        return self._views[cand]

    def _candidates(self, step: int, path: str | None) -> list[str]:
        from ckpt.restoring.discovery import step_dir

        out = []
        if path:
            out.append(path)
            # A run directory moved or copied since: same folder name under this root.
            out.append(f"{self.root}/{os.path.basename(str(path).rstrip('/'))}")
        out.append(f"{self.root}/{step_dir(step)}")
        return list(dict.fromkeys(out))

    def _load(self, step: int, path: str | None) -> CheckpointFacts | None:
        from ckpt.errors import CkptError
        from ckpt.format.reader import read_manifest
        from ckpt.storage import open_storage

        last_error = None
        for cand in self._candidates(step, path):
            try:
                manifest = read_manifest(open_storage(cand, self.storage_options))
            except (CkptError, OSError) as exc:  # not a ckpt checkpoint (a torch.save file), unreadable
                last_error = str(exc) or type(exc).__name__
                continue
            if int(manifest.step) != step:
                self.notes.append(f"checkpoint {cand} holds step {manifest.step}, the restore said {step}")
            return facts_from_manifest(manifest)
        self.notes.append(f"no readable checkpoint of step {step} under {self.root} ({last_error})")
        return None
