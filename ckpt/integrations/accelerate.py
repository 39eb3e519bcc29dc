"""``CkptStateHooks``: ``Accelerator.save_state()`` writes the model through ckpt, ``load_state()`` reads it back.

What accelerate 1.x lets a hook do, and so what this does:

- ``register_save_state_pre_hook(hook)`` calls ``hook(models, weights, output_dir)`` after the models' state dicts
  are taken and before ``save_accelerator_state`` writes anything.  ``weights`` is the list accelerate will write as
  ``model.safetensors``; emptying it is the documented way to take the model write over.  The optimizer,
  scheduler, data-loader, ``GradScaler``, RNG and custom states are not handed to the hook: **accelerate still
  writes those files itself, synchronously**, into ``output_dir``.
- ``register_load_state_pre_hook(hook)`` calls ``hook(models, input_dir)`` before ``load_accelerator_state``;
  removing a model from ``models`` stops accelerate from looking for its file.

So the hook saves the model weights (the largest part of the state without an optimizer, a third of it with
Adam) as step ``N`` of a :class:`~ckpt.CheckpointManager` at ``root``: through the async writer (the training
step waits only for the host copy, ``lazy=False``, not for the disk), with the manager's options (``local_dir=``,
``local_every=``, ``persist_every=``, ``replicas=``: the node-local tier; ``keep_last=``, ``codec=``, ...).  It
writes ``ckpt_step.json`` (``{"root", "step"}``) into ``output_dir`` so that ``load_state(output_dir)`` finds the
step, and ``ckpt ls/inspect/convert`` read the folder whole (the model from the step, the rest from accelerate's
files).  ``N`` is ``accelerator.save_iteration`` unless :attr:`CkptStateHooks.step` is set before ``save_state``.

Restorable bit-exactly, never half: the load hook waits for an in-flight save, refuses a folder whose step never
committed (a save killed before its manifest) or whose accelerate files are missing or torn (accelerate would
silently skip a torn ``random_states_*.pkl``), naming the file; :func:`latest_complete` finds the newest folder that
is neither, to resume from after a crash::

    hooks = CkptStateHooks(accelerator, "run/ckpt", local_dir="/dev/shm/ckpt")
    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    accelerator.load_state(latest_complete("run/checkpoints"))   # on a restart
    ...
    accelerator.save_state()          # the model goes through ckpt in the background
    hooks.close()                     # at the end: waits for the last save, raises its failure

One model per accelerator (a second is refused at the first save); FSDP and DeepSpeed save their models themselves
and never hand them to the hook, so they are refused when the hooks are attached.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Any

from ckpt.converters.accelerate_files import POINTER
from ckpt.errors import CkptError
from ckpt.manager import CheckpointManager

__all__ = ["POINTER", "CkptStateHooks", "latest_complete", "problems"]


class CkptStateHooks:
    """The save/load pre-hooks of ``accelerator`` (see the module docstring); construct on every process, after
    the ``Accelerator`` and before ``save_state`` / ``load_state``.  ``options``: :class:`~ckpt.CheckpointManager`'s
    (``async_save`` defaults to True here)."""

    def __init__(self, accelerator: Any, root: str, **options: Any) -> None:
        kind = str(getattr(accelerator, "distributed_type", ""))
        if "FSDP" in kind or "DEEPSPEED" in kind or "MEGATRON" in kind:
            raise CkptError(
                f"CkptStateHooks: accelerate saves {kind} models itself and never hands them to save hooks; "
                "use save_state alone, and ckpt convert on its folders"
            )
        self.accelerator = accelerator
        options.setdefault("async_save", True)
        self.manager = CheckpointManager(root, **options)
        #: the step the next ``save_state`` writes (None: ``accelerator.save_iteration``)
        self.step: int | None = None
        self._handles = [
            accelerator.register_save_state_pre_hook(self._save),
            accelerator.register_load_state_pre_hook(self._load),
        ]

    def _save(self, models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        if len(weights) != 1:
            raise CkptError(
                f"CkptStateHooks: save_state hands {len(weights)} models' weights; the hook writes exactly one"
            )
        step = self.step if self.step is not None else int(self.accelerator.save_iteration)
        self.step = None
        fut = self.manager.save(step, model=weights[0], rng=False, lazy=False)
        if fut.done() and fut.exception() is None and fut.result() is None:
            return  # a step no tier takes (local_every / persist_every): accelerate writes the model itself
        weights.clear()  # the model is ckpt's now: accelerate writes no model file
        if self.accelerator.is_main_process:
            root = self.manager.root
            doc: dict[str, Any] = {"root": root if "://" in root else os.path.abspath(root), "step": step}
            if self.manager.tiers is not None:  # where this node's local tier keeps the step
                doc["local"] = str(self.manager.tiers.root)
            with open(os.path.join(output_dir, POINTER), "w") as fh:
                json.dump(doc, fh)

    def _load(self, models: list[Any], input_dir: str) -> None:
        pointer = read_pointer(input_dir)
        if pointer is None:
            return  # a folder accelerate wrote whole: it loads it itself
        self.manager.wait()
        # every process decides together: one that refused alone would leave the others in the restore's collectives
        mine = problems(input_dir, self.accelerator.process_index)[:1]
        bad = [(r, b[0]) for r, b in enumerate(self.manager.coll.all_gather(mine)) if b]
        if bad:
            rank, why = bad[0]
            raise CkptError(
                f"{input_dir}: cannot resume from it: {why}" + (f" (process {rank})" if rank else "")
            )
        if len(models) != 1:
            raise CkptError(
                f"CkptStateHooks: load_state hands {len(models)} models; the hook restores exactly one"
            )
        step = int(pointer["step"])
        if self.manager.tiers is None:
            self.manager.restore(step, model=models[0], rng=False)
        else:
            got = self.manager.restore_latest(model=models[0], rng=False)
            if got != step:
                raise CkptError(
                    f"{input_dir}: its model is step {step}, but the newest step complete in the tiers is {got}; "
                    "load the folder of that step"
                )
        models.clear()  # restored: accelerate does not look for model.safetensors

    def wait(self) -> None:
        """Block until the in-flight model save is committed; raise its failure."""
        self.manager.wait()

    def close(self) -> None:
        """Wait for the last save (raising a background failure) and remove the hooks."""
        try:
            self.manager.close()
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []


def read_pointer(folder: str) -> dict[str, Any] | None:
    """The ``ckpt_step.json`` of a save_state folder (None: none; a damaged one is refused)."""
    path = os.path.join(folder, POINTER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as fh:
            doc = json.load(fh)
        int(doc["step"])
        str(doc["root"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CkptError(f"{path}: not a ckpt step pointer ({type(e).__name__}: {e})") from None
    return doc


def problems(folder: str, process_index: int = 0) -> list[str]:
    """Why ``folder`` (a save_state folder written with the hooks, or without) cannot be resumed from exactly:
    its model's step is committed neither at the root nor in this node's local tier (a restore with tiers then
    asks every node: the load hook), or accelerate's files are missing or torn (each ``torch.save`` file is a zip
    whose directory is written last).  Empty: complete."""
    from ckpt.format.manifest import MANIFEST_NAME
    from ckpt.restoring.discovery import step_dir

    out = []
    try:
        names = set(os.listdir(folder))
    except OSError as e:
        return [f"{folder}: unreadable ({e.strerror})"]
    pointer = read_pointer(folder)
    if pointer is not None:
        from ckpt.storage import open_storage

        name = step_dir(int(pointer["step"]))
        roots = [str(pointer["root"])] + ([str(pointer["local"])] if pointer.get("local") else [])
        if not any(open_storage(f"{r.rstrip('/')}/{name}").exists(MANIFEST_NAME) for r in roots):
            out.append(
                f"its model (step {pointer['step']} under {' or '.join(roots)}) is not there (a save interrupted "
                "before its commit, or pruned by retention)"
            )
    elif not names & {"model.safetensors", "pytorch_model.bin"}:
        out.append("no model file")
    rng = f"random_states_{process_index}.pkl"
    if rng not in names:
        out.append(f"{rng} missing (the save was interrupted)")
    for name in sorted(names):
        if name.endswith((".bin", ".pkl", ".pt")) and name != "pytorch_model.bin":
            try:
                with zipfile.ZipFile(os.path.join(folder, name)):
                    pass
            except (OSError, zipfile.BadZipFile):
                out.append(f"{name} is torn (not a complete torch.save file)")
    return out


def latest_complete(checkpoints: str) -> str | None:
    """The newest folder under ``checkpoints`` (``checkpoint_<n>``, by ``n``; or any save_state folders, by name)
    with no :func:`problems`; None when there is none."""
    import re

    try:
        entries = [e for e in os.listdir(checkpoints) if os.path.isdir(os.path.join(checkpoints, e))]
    except OSError:
        return None

    def key(name: str) -> tuple[int, str]:
        m = re.search(r"(\d+)$", name)
        return (int(m.group(1)) if m else -1, name)

    for name in sorted(entries, key=key, reverse=True):
        path = os.path.join(checkpoints, name)
        if not problems(path):
            return path
    return None
