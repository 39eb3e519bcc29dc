"""Fill :class:`CheckpointFacts` from HF ``Trainer`` checkpoint folders (``OUTPUT_DIR/checkpoint-N``).

What the verifier needs from a Trainer checkpoint, and where it lives:

- the step: ``trainer_state.json`` ``global_step``;
- the scheduler position: ``scheduler.pt`` (``last_epoch`` and ``_last_lr``, the LR of the next update);
- the optimizer's per-parameter ``step`` counters: ``optimizer.pt`` (memory-mapped: only the scalars are
  read, never the moments) and its settings per param group (betas, weight decay, ...);
- which state files are missing.  ``Trainer._load_optimizer_and_scheduler`` loads *neither* optimizer nor
  scheduler when ``scheduler.pt`` is absent, so a checkpoint without it resumes with a fresh warmup and fresh
  Adam moments; the counters check names the file.

The ``.pt`` files are foreign pickles: read with :func:`ckpt.safe_unpickle.load_torch_file` (weights_only and
an allow-list), so a crafted file cannot run code.  As with manifests, a checkpoint that cannot be read yields
no facts and a note, never an error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ckpt.resume.facts import CachedFacts, CheckpointFacts, folder_digest
from ckpt.resume.manifest_facts import _as_int, scheduler_position
from ckpt.resume.restore_facts import group_hyperparameters

MISSING_WHY = {
    "scheduler.pt": "without it Trainer restores neither the scheduler nor optimizer.pt: warmup and Adam "
    "moments start afresh",
    "optimizer.pt": "without it Trainer restores neither the optimizer nor the scheduler",
    "rng_state.pth": "without it the RNG streams start from the seed again",
}


def is_trainer_output(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds ``checkpoint-N`` folders (a Trainer output dir)."""
    p = Path(path)
    return p.is_dir() and any(d.is_dir() and d.name.startswith("checkpoint-") for d in p.iterdir())


def facts_from_trainer_checkpoint(folder: str | os.PathLike[str], step: int | None = None) -> CheckpointFacts:
    """Counters of one ``checkpoint-N`` folder; raises ``OSError``/``CkptError`` when it cannot be read."""
    from ckpt.safe_unpickle import load_torch_file

    d = Path(folder)
    state_file = d / "trainer_state.json"
    global_step = step
    if state_file.is_file():
        global_step = int(json.loads(state_file.read_text()).get("global_step", step))
    if global_step is None:
        raise OSError(f"{state_file} is missing")
    missing: list[str] = []
    last_epoch = last_lr = None
    if (d / "scheduler.pt").is_file():
        last_epoch, last_lr = scheduler_position(load_torch_file(d / "scheduler.pt"))
    else:
        missing.append("scheduler.pt")
    opt_steps: dict[str, int] = {}
    hyper = None
    if (d / "optimizer.pt").is_file():
        opt: Any = load_torch_file(d / "optimizer.pt", mmap=True)
        groups = opt.get("param_groups") if isinstance(opt, dict) else None
        if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
            hyper = tuple(group_hyperparameters(groups))
        for key, st in (opt.get("state") or {}).items() if isinstance(opt, dict) else ():
            if isinstance(st, dict) and "step" in st:
                value = _as_int(st["step"])
                if value is not None:
                    opt_steps[f"param {key}"] = value
    else:
        missing.append("optimizer.pt")
    if not any(d.glob("rng_state*.pth")):
        missing.append("rng_state.pth")
    return CheckpointFacts(
        step=global_step,
        optimizer_steps=opt_steps or None,
        scheduler_last_epoch=last_epoch,
        scheduler_last_lr=last_lr,
        missing=tuple(f"{name} ({MISSING_WHY[name]})" for name in missing),
        optimizer_hyper=hyper,
    )


def trainer_digest(folder: str) -> Any:
    """The model digest of one ``checkpoint-N``: a PEFT model's checkpoint holds the adapter alone
    (``adapter_model.safetensors``), hashed under the names the live ``PeftModel`` gives its tensors
    (:func:`ckpt.converters.digest.adapter_digest`), so the restore digest compares with it; any other through the
    conversion engine's full HF-named view."""
    from ckpt.converters import peft
    from ckpt.converters.digest import adapter_digest, source_digest

    return adapter_digest(folder) if peft.detect(folder) else source_digest(folder)


class TrainerCheckpointFacts(CachedFacts):
    """A :data:`ckpt.resume.facts.FactsProvider` over the ``checkpoint-N`` folders of a Trainer output dir."""

    def __init__(self, output_dir: str | os.PathLike[str]) -> None:
        self.root = Path(output_dir)
        self.notes: list[str] = []
        super().__init__()
        self._digests: dict[Path, Any] = {}
        self._samples: dict[Path, Any] = {}

    def checkpoints(self) -> list[tuple[int, str]]:
        """(step, folder) of every ``checkpoint-N`` under the output dir, oldest first."""
        out = []
        for d in self.root.iterdir() if self.root.is_dir() else ():
            tail = d.name.removeprefix("checkpoint-")
            if d.is_dir() and d.name.startswith("checkpoint-") and tail.isdigit():
                out.append((int(tail), str(d)))
        return sorted(out)

    def digest(self, step: int, path: str | None) -> Any:
        """The model digest of ``checkpoint-N``, hashed through the conversion engine's view of its weights (one
        read of the model, cached); None when it cannot be read."""
        cands = [Path(path), self.root / Path(path).name] if path else []
        cands.append(self.root / f"checkpoint-{step}")
        return folder_digest(cands, self._digests, self.notes, read=trainer_digest)

    def sample(self, step: int, path: str | None) -> dict[str, str] | None:
        """The weight sample of ``checkpoint-N``'s ``*.safetensors`` (:func:`ckpt.state.save_facts.safetensors_sample`,
        only the rows holding sampled elements are read), compared with the save event's fingerprint; None (and a
        note) when it cannot be read."""
        from ckpt.state.save_facts import safetensors_sample

        cands = [Path(path), self.root / Path(path).name] if path else []
        cands.append(self.root / f"checkpoint-{step}")
        for d in dict.fromkeys(cands):
            if d in self._samples:
                return self._samples[d]
            if not d.is_dir():
                continue
            from safetensors import SafetensorError

            try:
                found = self._samples[d] = safetensors_sample(d)
            except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
                self.notes.append(f"{d}: weights not readable for the save-time sample ({exc})")
                found = self._samples[d] = None
            return found
        return None

    def view_digest(self, step: int, path: str | None) -> Any:
        """The same digest: a Trainer checkpoint is hashed in the conversion engine's full HF-named view already (a
        PEFT model's adapter-only checkpoint in the live ``PeftModel``'s names, :func:`trainer_digest`)."""
        return self.digest(step, path)

    def _load(self, step: int, path: str | None) -> CheckpointFacts | None:
        from ckpt.errors import CkptError

        cands = [Path(path)] if path else []
        cands += [self.root / Path(path).name] if path else []
        cands.append(self.root / f"checkpoint-{step}")
        for d in dict.fromkeys(cands):
            if not d.is_dir():
                continue
            try:
                return facts_from_trainer_checkpoint(d, step)
            except (CkptError, OSError, ValueError) as exc:
                self.notes.append(f"{d}: unreadable ({exc})")
                return None
        self.notes.append(f"no checkpoint-{step} under {self.root}")
        return None
