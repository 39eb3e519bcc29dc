"""A second source of truth for ``verify-resume``: real ``transformers.Trainer`` runs the thresholds never saw.

Why: the verifier's thresholds were set on :mod:`ckpt.resume.truth` (one MLP, warmup + cosine, i.i.d. gradient
noise).  Its rates mean something only on runs made independently of it.  Here every run is a real
``Trainer`` training a tiny ``LlamaForCausalLM`` on the Python documentation tokenized by a BPE trained on it
(:mod:`ckpt.resume.truth_corpus`), with each ``transformers.get_scheduler`` type, gradient accumulation, bf16
autocast, logging every step or every 10th (the Trainer's own averaging), checkpoints as ``checkpoint-N``
folders, the Trainer's own ``TensorBoardCallback`` (logs only) and ``CkptCallback`` (the ledger).

One *trunk* per config: a Trainer trains from step 1 and crashes (an exception out of a callback: no exit, the
ledger left open) ``overlap_steps`` after checkpoint N, or right after it.  Each class is a branch: a copy of
the trunk's output dir resumed with ``resume_from_checkpoint`` by a fresh ``Trainer`` around a freshly
initialised model, with one defect planted the way a buggy tool or callback would (:data:`DEFECTS`, see
:func:`_plant_files` and :class:`_Defect`).  ``bench/verify_resume_truth.py --source trainer`` runs the grid.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt.resume import truth_corpus as corpus

SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant_with_warmup",
    "inverse_sqrt",
    "warmup_stable_decay",
    "reduce_lr_on_plateau",
)
"""Every ``transformers.get_scheduler`` type a run is trained with (by seed)."""

DEFECTS = (
    "clean",
    "clean_nondeterministic",
    "weights_fresh",
    "weights_stale",
    "weights_stale_saved",
    "lr_halved",
    "scheduler_lost",
    "lr_off_by_one",
    "optimizer_reset",
    "moments_zeroed",
    "betas_changed",
    "weight_decay_changed",
    "accumulation_changed",
    "data_restarted",
    "lr_scaled_silently",
    "rng_lost",
    "older_checkpoint",
)
"""The generator's classes (``data_reset`` is ``data_restarted`` here: ``ignore_data_skip``) plus the optimizer
moments zeroed with the step kept, betas or weight decay changed, gradient accumulation changed, and the LR
scaled inside the optimizer step while the scheduler's (logged) LR is not."""
CLEAN = frozenset(d for d in DEFECTS if d.startswith("clean"))
EXTRA_DEFECTS = ("clean", "clean_nondeterministic", "weights_fresh", "scheduler_lost", "lr_off_by_one")
"""The branches of the extra trunks (a torch ``StepLR`` whose first milestone is N+1, a curriculum whose phase
changes at N+1): clean resumes there must pass, and the schedule defects must still be caught."""
STALE_STEPS = 5
EVENTS = {
    "cosine_with_restarts": "warm restart",
    "warmup_stable_decay": "decay start",
    "step_lr": "StepLR milestone",
}
NONDETERMINISM = 1e-3
"""``clean_nondeterministic``: Gaussian gradient noise of this size relative to each gradient's mean magnitude,
from a generator no checkpoint carries (atomics-based GPU kernels, exaggerated)."""


@dataclass(frozen=True)
class TrainerTruthConfig:
    """One trunk.  :meth:`from_seed` spreads the grid over schedulers, accumulation, bf16, logging and N."""

    seed: int = 0
    scheduler: str = "cosine"
    overlap: bool = True
    accumulation: int = 1
    bf16: bool = False
    logging_steps: int = 1
    restored: int = 30
    total: int = 60
    save_every: int = 10
    warmup: int = 6
    batch: int = 8
    lr: float = 3e-3
    overlap_steps: int = 7
    curriculum: bool = False
    """The data switches from plain text to shuffled tokens at step N+1, logged as ``data/phase`` 1 -> 2."""

    @classmethod
    def from_seed(cls, seed: int, overlap: bool = True, **kw: Any) -> TrainerTruthConfig:
        values: dict[str, Any] = {
            "seed": seed,
            "overlap": overlap,
            "scheduler": SCHEDULERS[seed % len(SCHEDULERS)],
            "accumulation": 1 + (seed // len(SCHEDULERS)) % 2,
            "bf16": (seed // 3) % 2 == 1,
            "logging_steps": 10 if seed % 5 == 4 else 1,
            "restored": (20, 30, 40)[seed % 3],
        }
        values.update(kw)
        return cls(**values)

    @property
    def crash(self) -> int:
        return self.restored + (self.overlap_steps if self.overlap else 0)

    @property
    def event(self) -> str | None:
        """What the run itself changes at N+1, where a clean resume must still pass: a warm restart
        (``cosine_with_restarts``), the start of the decay (``warmup_stable_decay``), a ``StepLR`` milestone, a
        curriculum phase; None when nothing."""
        if self.curriculum:
            return "curriculum phase"
        return EVENTS.get(self.scheduler)

    event_at_boundary = property(lambda self: self.event is not None)

    def scheduler_kwargs(self) -> dict[str, Any]:
        n, w, t = self.restored, self.warmup, self.total
        if self.scheduler == "cosine_with_restarts":
            # cycles of length N - warmup: the first warm restart is at N (so step N+1 trains at the peak)
            return {"num_cycles": (t - w) / (n - w)}
        if self.scheduler == "warmup_stable_decay":
            return {"num_stable_steps": n - w, "num_decay_steps": t - n}
        if self.scheduler == "polynomial":
            return {"power": 2.0, "lr_end": 1e-5}
        return {}


class Crash(Exception):
    """Raised out of a callback: the process 'dies' after the step (and its save)."""


def _crash_at(step: int) -> Any:
    """A callback that raises :class:`Crash` once step ``step`` is logged and saved (it must come last, so the
    TensorBoard and ledger callbacks have written the step and the save)."""
    from transformers import TrainerCallback

    class CrashAt(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == step and not (control.should_log or control.should_save):
                raise Crash(step)

        def on_log(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == step and not control.should_save:
                raise Crash(step)

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == step:
                raise Crash(step)

    return CrashAt()


def _args(cfg: TrainerTruthConfig, out: Path, defect: str) -> Any:
    from transformers import TrainingArguments

    plateau = cfg.scheduler == "reduce_lr_on_plateau"
    kind = "constant" if cfg.scheduler == "step_lr" else cfg.scheduler  # StepLR: built by _StepLRTrainer
    return TrainingArguments(
        output_dir=str(out), max_steps=cfg.total, save_steps=cfg.save_every, logging_steps=cfg.logging_steps,
        per_device_train_batch_size=cfg.batch,
        gradient_accumulation_steps=cfg.accumulation * (2 if defect == "accumulation_changed" else 1),
        learning_rate=cfg.lr, warmup_steps=0 if kind == "constant" else cfg.warmup, lr_scheduler_type=kind,
        lr_scheduler_kwargs=cfg.scheduler_kwargs(), weight_decay=0.01, seed=cfg.seed, data_seed=cfg.seed,
        full_determinism=defect != "clean_nondeterministic", use_cpu=True, bf16=cfg.bf16, report_to=[],
        dataloader_num_workers=0, save_total_limit=None, disable_tqdm=True,
        ignore_data_skip=defect == "data_restarted",
        eval_strategy="steps" if plateau else "no", eval_steps=5 if plateau else None,
        metric_for_best_model="eval_loss" if plateau else None,
    )  # fmt: skip


def _reset_accelerate() -> None:
    """Trainers of one process share accelerate's singleton state; a run with other mixed-precision settings
    (bf16 or not) needs it fresh, as a new process would have it."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def _tensorboard(out: Path) -> Any:
    """The Trainer's own ``TensorBoardCallback``, writing into ``OUT/tb`` (one event file per process)."""
    from torch.utils.tensorboard import SummaryWriter
    from transformers.integrations import TensorBoardCallback

    return TensorBoardCallback(SummaryWriter(str(out / "tb")))


def _curriculum(cfg: TrainerTruthConfig) -> tuple[Any, Any]:
    """(dataset, callback): text before step N+1, the same blocks with their tokens shuffled from N+1 on (a
    harder mix); the callback switches the phase before the batches of step N+1 are fetched and logs it as
    ``data/phase`` (a key both ``TensorBoardCallback`` and ``CkptCallback`` write)."""
    from transformers import TrainerCallback

    easy = corpus.examples(512, offset=cfg.seed * 997)
    g = torch.Generator().manual_seed(cfg.seed)
    hard = []
    for ex in easy:
        x = ex["input_ids"][torch.randperm(ex["input_ids"].numel(), generator=g)]
        hard.append({"input_ids": x, "labels": x.clone()})

    class Mix(torch.utils.data.Dataset):
        phase = 1

        def __len__(self) -> int:
            return len(easy)

        def __getitem__(self, i: int) -> Any:
            return (hard if self.phase == 2 else easy)[i]

    data = Mix()

    # accelerate's loader fetches one batch ahead: step N+1's batch is fetched after step N-1 ends
    class Phase(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            data.phase = 2 if state.global_step >= cfg.restored - 1 else 1

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            data.phase = 2 if state.global_step >= cfg.restored - 1 else 1

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs is not None and "loss" in logs:
                logs["data/phase"] = 2 if state.global_step > cfg.restored else 1

    return data, Phase()


def _step_lr_trainer(cfg: TrainerTruthConfig) -> Any:
    """A ``Trainer`` whose scheduler is a torch ``StepLR`` halving the LR every N steps (first milestone N+1)."""
    from transformers import Trainer

    class StepLRTrainer(Trainer):
        def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
            if self.lr_scheduler is None:
                opt = optimizer if optimizer is not None else self.optimizer
                self.lr_scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=cfg.restored, gamma=0.5)
                self._created_lr_scheduler = True
            return self.lr_scheduler

    return StepLRTrainer


def _trainer(
    cfg: TrainerTruthConfig,
    out: Path,
    defect: str,
    first: list[Any],
    init_seed: int,
    last: tuple[Any, ...] = (),
) -> Any:
    from transformers import Trainer

    from ckpt.integrations.transformers import CkptCallback

    _reset_accelerate()
    torch.set_num_threads(1)
    model = corpus.tiny_llama(init_seed)
    plateau = cfg.scheduler == "reduce_lr_on_plateau"
    data: Any = corpus.examples(512, offset=cfg.seed * 997)
    if cfg.curriculum:
        data, phase = _curriculum(cfg)
        first = [phase, *first]
    cls = _step_lr_trainer(cfg) if cfg.scheduler == "step_lr" else Trainer
    # the defect's callbacks come first: a user's buggy callback runs before ckpt's sees the state
    return cls(
        model=model,
        args=_args(cfg, out, defect),
        train_dataset=data,
        eval_dataset=corpus.examples(16, offset=cfg.seed * 997 + 4000) if plateau else None,
        callbacks=[*first, _tensorboard(out), CkptCallback(), *last],
    )


def _crash_cleanup(trainer: Any) -> None:
    """What a killed process leaves: TensorBoard flushed (as after its flush interval), the ledger open."""
    from transformers.integrations import TensorBoardCallback

    from ckpt.integrations.transformers import CkptCallback

    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, TensorBoardCallback) and cb.tb_writer is not None:
            cb.tb_writer.flush()
            cb.tb_writer.close()
        if isinstance(cb, CkptCallback) and cb.ledger is not None:
            cb._detach()
            cb.ledger.__exit__(RuntimeError, RuntimeError("killed"), None)
            cb.ledger = None


def trunk(cfg: TrainerTruthConfig, root: Path) -> Path:
    """Session 1: train to the crash; also write the model of step N - ``STALE_STEPS`` aside (``root/stale``)."""
    from transformers import TrainerCallback

    out = root / "trunk"
    stale = root / "stale.safetensors"

    class Snapshot(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if state.global_step == cfg.restored - STALE_STEPS:
                from safetensors.torch import save_file

                sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
                save_file(sd, str(stale), metadata={"format": "pt"})

    trainer = _trainer(cfg, out, "clean", [Snapshot()], init_seed=cfg.seed, last=(_crash_at(cfg.crash),))
    try:
        trainer.train()
    except Crash:
        _crash_cleanup(trainer)
    else:  # pragma: no cover - the crash step is inside max_steps
        raise RuntimeError(f"trunk of {cfg} did not crash")
    return out


def _plant_files(cfg: TrainerTruthConfig, root: Path, out: Path, defect: str) -> None:
    """Defects made by editing ``checkpoint-N`` as a buggy tool would (the trunk's copy, never the trunk)."""
    ck = out / f"checkpoint-{cfg.restored}"
    if defect == "weights_stale":
        shutil.copyfile(root / "stale.safetensors", ck / "model.safetensors")
    elif defect == "weights_stale_saved":
        shutil.copyfile(
            out / f"checkpoint-{cfg.restored - cfg.save_every}" / "model.safetensors",
            ck / "model.safetensors",
        )
    elif defect == "rng_lost":
        for p in ck.glob("rng_state*.pth"):
            p.unlink()
    elif defect == "scheduler_lost" and cfg.scheduler != "reduce_lr_on_plateau":
        # the state of a scheduler that never stepped: warmup starts again
        sched = torch.load(ck / "scheduler.pt", weights_only=True)
        sched.update(last_epoch=0, _step_count=1, _last_lr=[0.0 for _ in sched["_last_lr"]])
        torch.save(sched, ck / "scheduler.pt")


def _defect_callbacks(cfg: TrainerTruthConfig, defect: str, seed: int) -> list[Any]:
    """Defects planted in the live objects after the Trainer restored them (``on_train_begin``)."""
    from transformers import TrainerCallback

    def inner(opt: Any) -> Any:
        return getattr(opt, "optimizer", opt)

    class Plant(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 0:
                return
            model, opt, sched = kw.get("model"), inner(kw.get("optimizer")), kw.get("lr_scheduler")
            if defect == "weights_fresh":
                fresh = corpus.tiny_llama(seed + 31_337).state_dict()
                model.load_state_dict(fresh)
            elif defect == "lr_halved" and hasattr(sched, "base_lrs"):
                sched.base_lrs = [b / 2 for b in sched.base_lrs]
            elif defect == "lr_off_by_one":
                sched.step()
            elif defect == "optimizer_reset":
                opt.state.clear()
            elif defect == "moments_zeroed":
                for st in opt.state.values():
                    for key in ("exp_avg", "exp_avg_sq"):
                        if key in st:
                            st[key].zero_()
            elif defect == "betas_changed":
                for g in opt.param_groups:
                    g["betas"] = (0.5, 0.9)
            elif defect == "weight_decay_changed":
                for g in opt.param_groups:
                    g["weight_decay"] = 1.0
            elif defect == "lr_scaled_silently":
                scale = {"lr": None}

                def pre(o: Any, *_: Any) -> None:
                    scale["lr"] = [g["lr"] for g in o.param_groups]
                    for g in o.param_groups:
                        g["lr"] *= 0.5

                def post(o: Any, *_: Any) -> None:
                    for g, lr in zip(o.param_groups, scale["lr"] or [], strict=False):
                        g["lr"] = lr

                opt.register_step_pre_hook(pre)
                opt.register_step_post_hook(post)
            elif defect == "clean_nondeterministic":
                g = torch.Generator().manual_seed(seed * 7 + 1)

                def noise(o: Any, *_: Any) -> None:
                    for group in o.param_groups:
                        for p in group["params"]:
                            if p.grad is not None:
                                s = float(p.grad.abs().mean()) * NONDETERMINISM
                                p.grad.add_(torch.randn(p.grad.shape, generator=g).to(p.grad.dtype) * s)

                opt.register_step_pre_hook(noise)

    return [Plant()]


def branch(cfg: TrainerTruthConfig, root: Path, defect: str) -> Path:
    """Copy the trunk's output dir and resume it with ``defect`` planted; returns the output dir."""
    if defect not in DEFECTS:
        raise ValueError(f"unknown defect {defect!r}; expected one of {', '.join(DEFECTS)}")
    out = root / defect
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(root / "trunk", out)
    _plant_files(cfg, root, out, defect)
    restore = cfg.restored - cfg.save_every if defect == "older_checkpoint" else cfg.restored
    trainer = _trainer(cfg, out, defect, _defect_callbacks(cfg, defect, cfg.seed), init_seed=cfg.seed + 7_777)
    trainer.train(resume_from_checkpoint=str(out / f"checkpoint-{restore}"))
    return out


os.environ.setdefault("USE_TORCH_XLA", "0")


# ------------------------------------------------------------------------------------------- measuring
VIEWS = (("tensorboard", False), ("tensorboard", True), ("ledger", None))
"""(format, --deterministic): the Trainer's TensorBoard events (logs only) in the default mode and with
``--deterministic``; ``CkptCallback``'s ledger with the ``checkpoint-N`` folders' facts, in its default mode."""
EFFECT_STEPS = 10


def judge(out: Path, fmt: str, deterministic: bool | None) -> dict[str, Any]:
    """What ``ckpt verify-resume`` says about one view of a branch: exit code and causes."""
    from ckpt.resume.checks import VerifyOptions
    from ckpt.resume.hf_facts import TrainerCheckpointFacts
    from ckpt.resume.sources import load_run
    from ckpt.resume.verify import verify_run

    if fmt == "tensorboard":
        run, facts = load_run(out / "tb", "tensorboard"), None
    else:
        run, facts = load_run(out / "ledger.jsonl", "jsonl"), TrainerCheckpointFacts(str(out))
    result = verify_run(run, options=VerifyOptions(deterministic=deterministic), facts=facts)
    causes = [c.value for c in result.causes]
    return {"exit": result.exit_code, "causes": causes, "cannot_tell": bool(result.undecided)}


def effect(clean: Path, broken: Path, restored: int) -> dict[str, float]:
    """The defect's effect against the clean branch on the same steps (mean relative loss difference over the
    first ``EFFECT_STEPS`` resumed steps logged by both, largest relative difference of the *logged* LR)."""
    import math

    from ckpt.resume.sources import read_jsonl

    a = {r.step: r for r in read_jsonl(clean / "ledger.jsonl").sessions[-1].steps}
    b = {r.step: r for r in read_jsonl(broken / "ledger.jsonl").sessions[-1].steps}
    steps = [s for s in range(restored + 1, restored + 1 + EFFECT_STEPS) if s in a and s in b]
    steps = steps or sorted(set(a) & set(b))[:1]
    if not steps:
        return {"loss": math.nan, "lr": math.nan}
    loss = sum((b[s].loss - a[s].loss) / abs(a[s].loss) for s in steps) / len(steps)  # type: ignore[operator]
    lr = max(abs(b[s].lr - a[s].lr) / max(abs(a[s].lr), 1e-12) for s in steps)  # type: ignore[operator]
    return {"loss": loss, "lr": lr}


def measure(cfg: TrainerTruthConfig, root: Path, defects: tuple[str, ...] = DEFECTS, views: Any = VIEWS) -> Any:
    """One trunk, every branch, every view (of ``views``): one row per (defect, view), verdict and effect."""
    trunk(cfg, root)
    runs = {d: branch(cfg, root, d) for d in dict.fromkeys(("clean", *defects))}
    rows = []
    for d in defects:
        eff = effect(runs["clean"], runs[d], cfg.restored)
        for fmt, det in views:
            rows.append(
                {
                    "source": "trainer",
                    "defect": d,
                    "seed": cfg.seed,
                    "scheduler": cfg.scheduler,
                    "accumulation": cfg.accumulation,
                    "bf16": cfg.bf16,
                    "every": cfg.logging_steps,
                    "event_at_boundary": cfg.event_at_boundary,
                    "event": cfg.event,
                    "curriculum": cfg.curriculum,
                    "overlap": cfg.overlap,
                    "restored": cfg.restored,
                    "format": fmt,
                    "deterministic": det,
                    "loss_effect": eff["loss"],
                    "lr_effect": eff["lr"],
                    **judge(runs[d], fmt, det),
                }
            )
    return rows
