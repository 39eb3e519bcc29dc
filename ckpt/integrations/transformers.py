"""``CkptCallback``: the run ledger written from inside Hugging Face ``Trainer``, nothing else to change.

Why a callback: ``Trainer`` (and optimum-neuron's ``NeuronTrainer``, same callback API) owns the loop, so the
only place to see each step, save and restart is its callback hooks.  The ledger it writes
(``OUTPUT_DIR/ledger.jsonl``, docs/run-dir.md) is what ``ckpt verify-resume OUTPUT_DIR`` reads; the
``checkpoint-N`` folders beside it give the verifier the restored scheduler and optimizer counters.

Usage::

    from ckpt.integrations.transformers import CkptCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[CkptCallback()])
    trainer.train(resume_from_checkpoint=True)   # after a crash: logs the restore of checkpoint-N

What is logged, and from which hook:

- ``on_train_begin``: a session (versions, world size, seed, ``full_determinism``); when ``global_step`` is
  already N > 0 the Trainer has restored ``checkpoint-N``, logged as a restore event at the first
  ``on_step_begin`` (or ``on_train_end`` when no step runs) with the live optimizer's update counter (the
  Trainer loads the optimizer before ``on_train_begin``: equal to N, it rules out a lost optimizer state when the
  loss jumps) and the digest of the model as that first step finds it (after every callback's
  ``on_train_begin``), so ``verify-resume`` can tell whether the weights are ``checkpoint-N``'s.  A forward
  pre-hook on the model sees every training batch.
- ``on_step_begin``: the RNG digest taken before the step draws anything.
- The forward pre-hook (training mode only, so evaluation is not counted): a digest of each micro-batch's
  ``input_ids`` (the first tensor argument when there is none) and its number of samples.  Without touching
  the user's data code, each step then logs the digest of the batches it consumed and the samples consumed so
  far, so a resume that restarted the data (``ignore_data_skip``, a rebuilt loader) is caught on the overlap.
  The count at each checkpoint is kept in ``checkpoint-N/ckpt_progress.json`` so a resumed session continues
  it.  ``data_digests=False`` turns this off (on XLA each digest copies the batch's ids to the host).
- ``on_log``: loss, the LR the update used, grad norm and (with ``include_num_input_tokens_seen``) tokens
  seen, per logged step.  Set ``logging_steps=1`` for a step-by-step ledger; the Trainer averages the loss
  over ``logging_steps``.
- ``on_save``: the ``checkpoint-N`` the Trainer has just written (it writes synchronously, so the event is
  logged once the files are there), and the sample count beside it; with the save-time facts
  (:mod:`ckpt.state.save_facts`): the digests of the RNG streams, which are what ``rng_state*.pth`` has just
  captured (nothing draws between the Trainer's save and this hook), and a fingerprint of the live weights.
  The restore event carries the RNG digests of the first step's ``on_step_begin``, which the Trainer reaches right
  after loading ``rng_state*.pth`` (except at an epoch start, where the new epoch's sampler may draw first: left
  out there).
- ``on_train_end``: a clean exit.

Only the world process zero writes (``state.is_world_process_zero``); the other ranks' callbacks do nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - the integration needs transformers
    raise ImportError("ckpt.integrations.transformers needs transformers: pip install transformers") from exc

from ckpt.resume.ledger import LedgerWriter, digest_ids, digest_rng, optimizer_step
from ckpt.resume.sources.base import is_phase_name

__all__ = ["CkptCallback"]

PROGRESS_FILE = "ckpt_progress.json"
"""Written into each ``checkpoint-N``: the samples the run had consumed at step N."""


def _checkpoint_dir(output_dir: str, step: int) -> str:
    """Where ``Trainer`` writes (and finds) the checkpoint of ``step``: ``OUTPUT_DIR/checkpoint-N``."""
    return os.path.join(output_dir, f"checkpoint-{step}")


def _resume_argument() -> str | None:
    """The folder ``Trainer.train(resume_from_checkpoint=...)`` is restoring from, read from the training loop.

    The Trainer hands callbacks neither the path nor itself, and the path given to ``train()`` is often outside
    ``output_dir`` (a converted checkpoint).  ``on_train_begin`` runs inside ``Trainer._inner_training_loop``,
    whose ``resume_from_checkpoint`` argument is that folder (``True`` already resolved to the newest one).
    """
    import inspect

    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "_inner_training_loop" and isinstance(
                frame.f_locals.get("self"), Trainer
            ):
                given = frame.f_locals.get("resume_from_checkpoint")
                return os.fspath(given) if isinstance(given, (str, os.PathLike)) else None
            frame = frame.f_back
        return None
    finally:
        del frame


def _restored_from(args: Any, step: int) -> str:
    """The checkpoint folder the Trainer restored ``step`` from: the ``train()`` argument, else
    ``args.resume_from_checkpoint``, else the output dir's ``checkpoint-N`` (where ``True`` finds it)."""
    for given in (_resume_argument(), getattr(args, "resume_from_checkpoint", None)):
        if isinstance(given, str) and os.path.isdir(given):
            return given
    return _checkpoint_dir(args.output_dir, step)


def _restored_state(optimizer: Any, scheduler: Any, folder: str | None) -> dict[str, Any]:
    """The restore record's ``optimizer`` (the live optimizer's settings and moments, as the resume will use
    them) and ``scheduled_lr`` (the checkpoint's ``scheduler.pt`` replayed through the live scheduler's class:
    the LRs of N+1, N+2, ...); each left out when it cannot be had."""
    from ckpt.resume.restore_facts import optimizer_summary, replay_scheduler

    out: dict[str, Any] = {}
    inner = getattr(
        optimizer, "optimizer", optimizer
    )  # accelerate's AcceleratedOptimizer wraps the torch one
    summary = optimizer_summary(inner) if inner is not None else None
    if summary is not None:
        out["optimizer"] = summary
    path = os.path.join(folder, "scheduler.pt") if folder else None
    if scheduler is not None and path and os.path.isfile(path):
        from ckpt.errors import CkptError
        from ckpt.safe_unpickle import load_torch_file

        try:
            state = load_torch_file(path)
        except (CkptError, OSError, ValueError):
            state = None
        lrs = replay_scheduler(scheduler, state) if isinstance(state, Mapping) else None
        if lrs is not None:
            out["scheduled_lr"] = lrs
    return out


def _read_samples(folder: str) -> int | None:
    """The sample count stored beside a checkpoint by :meth:`CkptCallback.on_save` (None when absent: a
    checkpoint written without the callback, whose count is unknown)."""
    try:
        with open(os.path.join(folder, PROGRESS_FILE)) as fh:
            value = json.load(fh).get("samples")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) else None


def _save_facts(folder: str, model: Any) -> dict[str, Any]:
    """The save event's facts (:mod:`ckpt.state.save_facts`): the RNG digests when the checkpoint holds an
    ``rng_state*.pth`` (not with ``save_only_model``), the fingerprint of the live weights, and their cost."""
    import glob

    from ckpt.state.save_facts import take

    facts, seconds = take(model, rng=bool(glob.glob(os.path.join(glob.escape(folder), "rng_state*.pth"))))
    return {**facts, "facts_seconds": seconds}


class CkptCallback(TrainerCallback):
    """Write the run ledger from ``Trainer``'s hooks (see the module docstring for what and when).

    ``run_dir`` defaults to the Trainer's ``output_dir`` so ``ckpt verify-resume OUTPUT_DIR`` finds both the
    ledger and the ``checkpoint-N`` folders.  ``tokenizer_id`` (``ckpt.resume.ledger.tokenizer_id(tok)``)
    lets the verifier catch a tokenizer change across a restart; ``extra_env`` adds keys to the session;
    ``digest_restores=False`` leaves the model digest out of the restore event (it costs one read of the model on
    the main process, device tensors copied to the host one at a time); ``data_digests=False`` stops the batch
    digests and sample counts (see the module docstring).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        tokenizer_id: str | None = None,
        extra_env: Mapping[str, object] | None = None,
        digest_restores: bool = True,
        data_digests: bool = True,
    ) -> None:
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.digest_restores = digest_restores
        self.tokenizer_id = tokenizer_id
        self.extra_env = dict(extra_env or {})
        self.data_digests = data_digests
        self.ledger: LedgerWriter | None = None
        self._rng: dict[int, str] = {}
        #: the restore not yet logged: (step, checkpoint folder), written with the model's digest
        self._restored: tuple[int, str, int | None] | None = None
        #: the restore record's optimizer summary and replayed LRs (``ckpt.resume.restore_facts``)
        self._restored_state: dict[str, Any] = {}
        #: whether the first step begins right after the Trainer loaded the RNG state (not at an epoch start)
        self._rng_at_first_step = False
        self._hook: Any = None
        self._micro: list[str] = []
        self._samples: int | None = None
        self._data: dict[int, tuple[str, int | None]] = {}

    # -- batches -----------------------------------------------------------------------------------------
    def _see_batch(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook: digest and count one training micro-batch."""
        if not module.training or self.ledger is None:
            return
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = next((a for a in (*args, *kwargs.values()) if hasattr(a, "shape") and len(a.shape)), None)
        if ids is None:
            return
        self._micro.append(digest_ids(ids.reshape(-1)) + f"/{tuple(ids.shape)}")
        if self._samples is not None:
            self._samples += int(ids.shape[0])

    def _attach(self, model: Any) -> None:
        if self.data_digests and model is not None and self._hook is None:
            self._hook = model.register_forward_pre_hook(self._see_batch, with_kwargs=True)

    def _detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # -- hooks -------------------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        if self.ledger is not None:  # a second train() call on the same Trainer: a new session
            self.ledger.close()
        run_dir = self.run_dir or Path(args.output_dir)
        self.ledger = LedgerWriter(
            run_dir,
            world_size=int(getattr(args, "world_size", 1) or 1),
            deterministic=bool(getattr(args, "full_determinism", False)),
            seed=getattr(args, "seed", None),
            tokenizer_id=self.tokenizer_id,
            extra_env={
                "framework": "transformers.Trainer",
                "gradient_accumulation_steps": int(getattr(args, "gradient_accumulation_steps", 1) or 1),
                **self.extra_env,
            },
        )
        self._micro, self._data = [], {}
        self._samples = 0
        if state.global_step > 0:
            folder = _restored_from(args, state.global_step)
            opt = kwargs.get("optimizer")
            self._restored = (state.global_step, folder, optimizer_step(opt) if opt is not None else None)
            self._restored_state = _restored_state(opt, kwargs.get("lr_scheduler"), folder)
            self._samples = _read_samples(folder)
            epoch = getattr(state, "epoch", None)
            self._rng_at_first_step = isinstance(epoch, (int, float)) and not float(epoch).is_integer()
        self._attach(kwargs.get("model"))

    def _log_restore(self, model: Any, first_step: bool = False) -> None:
        """Write the pending restore event, with the digest of ``model`` as training finds it (and, at the first
        step, the RNG digests as the Trainer's restore left them)."""
        if self.ledger is None or self._restored is None:
            return
        from ckpt.state.save_facts import rng_digests

        rng = rng_digests() if first_step and self._rng_at_first_step else None
        step, path, opt_step = self._restored
        self._restored = None
        digest = None
        if model is not None and self.digest_restores:
            from ckpt.converters.digest import live_digest

            digest = live_digest(model)
        self.ledger.restore(
            step,
            path,
            model_digest=digest.tensors if digest is not None else None,
            model_views=digest.views if digest is not None else None,
            optimizer_step=opt_step,
            rng_digests=rng,
            **self._restored_state,
        )
        self._restored_state = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ledger is not None:
            self._log_restore(kwargs.get("model"), first_step=True)
            self._rng[state.global_step + 1] = digest_rng()
            self._micro = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ledger is not None and self._micro:
            digest = self._micro[0] if len(self._micro) == 1 else digest_ids(self._micro)
            self._data[int(state.global_step)] = (digest, self._samples)
            self._micro = []

    def on_log(
        self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if self.ledger is None or not logs or "loss" not in logs:
            return  # eval metrics and the final summary are not training steps
        step = int(state.global_step)
        tokens = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        digest, samples = self._data.pop(step, (None, None))
        self.ledger.step(
            step,
            logs["loss"],
            logs.get("learning_rate"),
            grad_norm=logs.get("grad_norm"),
            tokens=tokens or None,
            samples=samples,
            data_digest=digest,
            rng_digest=self._rng.pop(step, None),
            epoch=logs.get("epoch") if isinstance(logs.get("epoch"), (int, float)) else None,
            phase={k: v for k, v in logs.items() if is_phase_name(k) and isinstance(v, (int, float, str))}
            or None,
        )
        self._rng = {s: d for s, d in self._rng.items() if s > step}
        self._data = {s: d for s, d in self._data.items() if s > step}

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ledger is not None:
            folder = _checkpoint_dir(args.output_dir, state.global_step)
            if self._samples is not None and os.path.isdir(folder):
                tmp = os.path.join(folder, PROGRESS_FILE + ".tmp")
                with open(tmp, "w") as fh:
                    json.dump({"step": int(state.global_step), "samples": self._samples}, fh)
                os.replace(tmp, os.path.join(folder, PROGRESS_FILE))
            self.ledger.save(state.global_step, folder, **_save_facts(folder, kwargs.get("model")))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._detach()
        if self.ledger is not None:
            self._log_restore(kwargs.get("model"))
            self.ledger.close()
            self.ledger = None
