"""Ground truth for ``verify-resume``: real training runs, crashed and restarted with known defects.

Why: a verifier tuned on a handful of examples can call a broken resume CONTINUOUS on the next run.  This
module makes many *real* runs per defect class (a tiny regression MLP, AdamW, linear warmup + cosine through
torch's ``LambdaLR``, batches from a shuffled loader with a saved position, dropout drawing from the torch RNG),
saves real ckpt checkpoints with :class:`ckpt.CheckpointManager` every ``save_every`` steps, crashes, and
restores through the manager with one defect planted in the restore.  Each run is logged the way users log:
TensorBoard event files (``torch.utils.tensorboard``) and the ckpt ledger (digests, sample counts, save and
restore events).  ``bench/verify_resume_truth.py`` runs the grid and writes the table in docs/verify-resume.md;
tests run a few seeds per class.

One *trunk* per (model size, seed, overlap): session 1 trains from step 1 and crashes at ``crash`` (7 steps
after checkpoint N with overlap, right after it without); every defect class is a branch that copies the
trunk's files and resumes from them, so the classes of one seed share the pre-crash history.  The clean
branch is also the counterfactual: a defect's *effect* is its resumed loss and LR against the clean branch's
on the same steps, which is what the detection threshold is stated in.
"""

from __future__ import annotations

import copy
import math
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckpt.manager import CheckpointManager
from ckpt.resume.checks import VerifyOptions
from ckpt.resume.ledger import LedgerWriter, checkpoints_dir, digest_ids, digest_rng, optimizer_step
from ckpt.resume.manifest_facts import ManifestFacts
from ckpt.resume.model import Run, Session
from ckpt.resume.sources import load_run
from ckpt.resume.verify import verify_run
from ckpt.state.save_facts import rng_digests

DEFECTS = (
    "clean",
    "clean_two_restarts",
    "clean_nondeterministic",
    "weights_fresh",
    "weights_stale",
    "weights_stale_saved",
    "lr_halved",
    "scheduler_lost",
    "lr_off_by_one",
    "optimizer_reset",
    "data_reset",
    "rng_lost",
    "older_checkpoint",
)
"""Defect classes planted in the restore; the ``clean*`` ones must come out continuous."""

CLEAN = frozenset(d for d in DEFECTS if d.startswith("clean"))
SIZES = {"small": (16, 1), "large": (128, 2)}
"""Model sizes: (hidden width, hidden layers)."""
OVERLAP_STEPS = 7
STALE_STEPS = 10
"""``weights_stale``: checkpoint N holds the weights of this many steps before N, a step with no checkpoint of its
own (an async save that copied too early).  ``weights_stale_saved``: checkpoint N holds checkpoint N - save_every's
weights (a staging buffer reused from the previous save), which the checkpoints' own digests show."""
NONDETERMINISM = 1e-4
"""``clean_nondeterministic``: Gaussian noise of this size relative to each gradient's scale, from a stream
that no restore carries (what atomics-based kernels do on GPUs, exaggerated)."""


@dataclass(frozen=True)
class TruthConfig:
    """One trunk: model size, seed, whether steps overlap, and the run's shape."""

    size: str = "small"
    seed: int = 0
    overlap: bool = True
    total: int = 160
    warmup: int = 10
    save_every: int = 20
    base_lr: float = 3e-3
    batch: int = 512
    n_data: int = 16384
    features: int = 8
    noise: float = 0.2

    @property
    def restored(self) -> int:
        """Checkpoint N the crash leaves newest: early, middle or late in the schedule (by seed)."""
        return (60, 80, 100, 120)[self.seed % 4]

    @property
    def needed_saves(self) -> frozenset[int]:
        """The checkpoints some branch restores (N, N - save_every, and N + save_every for a second restart):
        saving only those keeps a run at a few seconds."""
        return frozenset((self.restored - self.save_every, self.restored, self.restored + self.save_every))

    @property
    def crash(self) -> int:
        return self.restored + (OVERLAP_STEPS if self.overlap else 0)

    def lr_factor(self, i: int) -> float:
        if i < self.warmup:
            return (i + 1) / self.warmup
        return 0.5 * (1.0 + math.cos(math.pi * (i - self.warmup) / (self.total - self.warmup)))


class Loader:
    """Shuffled batches of sample ids with a saved position (epoch, index): ``dataloader=`` of the manager."""

    def __init__(self, cfg: TruthConfig) -> None:
        self.cfg, self.epoch, self.index = cfg, 0, 0

    def next(self) -> torch.Tensor:
        per_epoch = self.cfg.n_data // self.cfg.batch
        if self.index >= per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        g = torch.Generator().manual_seed(self.cfg.seed * 1000 + self.epoch)
        ids = torch.randperm(self.cfg.n_data, generator=g)[
            self.index * self.cfg.batch : (self.index + 1) * self.cfg.batch
        ]
        self.index += 1
        return ids

    @property
    def samples(self) -> int:
        return (self.epoch * (self.cfg.n_data // self.cfg.batch) + self.index) * self.cfg.batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def _data(cfg: TruthConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression task per seed: a random teacher network plus label noise."""
    g = torch.Generator().manual_seed(10_000 + cfg.seed)
    x = torch.randn(cfg.n_data, cfg.features, generator=g)
    w1 = torch.randn(cfg.features, 32, generator=g) / math.sqrt(cfg.features)
    w2 = torch.randn(32, 1, generator=g) / math.sqrt(32)
    y = 2.0 * torch.tanh(x @ w1) @ w2 + 1.0 + cfg.noise * torch.randn(cfg.n_data, 1, generator=g)
    return x, y


def _model(cfg: TruthConfig, init_seed: int) -> torch.nn.Module:
    width, depth = SIZES[cfg.size]
    torch.manual_seed(init_seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(cfg.features, width), torch.nn.GELU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers += [torch.nn.Dropout(0.1), torch.nn.Linear(width, 1)]
    return torch.nn.Sequential(*layers)


@dataclass
class _State:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    loader: Loader

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.opt,
            "scheduler": self.sched,
            "dataloader": self.loader,
        }


def _build(cfg: TruthConfig, init_seed: int) -> _State:
    model = _model(cfg, init_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.base_lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cfg.lr_factor)
    return _State(model, opt, sched, Loader(cfg))


@dataclass
class Logs:
    """Where one process logs: TensorBoard (a new event file per process) and the ledger (a new session)."""

    run: Path
    deterministic: bool = True
    ledger: LedgerWriter = field(init=False)
    tb: Any = field(init=False)

    def __post_init__(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.ledger = LedgerWriter(self.run, world_size=1, deterministic=self.deterministic)
        self.tb = SummaryWriter(str(self.run / "tb"))

    def step(self, step: int, loss: float, lr: float, **extra: Any) -> None:
        self.ledger.step(step, loss, lr, **extra)
        self.tb.add_scalar("loss", loss, step)
        self.tb.add_scalar("lr", lr, step)

    def crash(self) -> None:
        """The process dies: what it logged is on disk (TensorBoard flushed), no clean exit."""
        self.tb.flush()
        self.tb.close()
        self.ledger.__exit__(RuntimeError, RuntimeError("killed"), None)


def _train(
    cfg: TruthConfig,
    st: _State,
    logs: Logs,
    mgr: CheckpointManager,
    first: int,
    last: int,
    *,
    save: bool = True,
    noise: torch.Generator | None = None,
    stale: CheckpointManager | None = None,
    stale_saved: CheckpointManager | None = None,
) -> None:
    """Steps ``first``..``last`` (1-based counts of updates), logging each and saving every ``save_every``."""
    x, y = _data(cfg)
    st.model.train()
    for step in range(first, last + 1):
        rng = digest_rng()
        ids = st.loader.next()
        loss = torch.nn.functional.mse_loss(st.model(x[ids]), y[ids])
        st.opt.zero_grad()
        loss.backward()
        if noise is not None:
            for p in st.model.parameters():
                if p.grad is not None:
                    scale = float(p.grad.abs().mean()) * NONDETERMINISM
                    p.grad.add_(torch.randn(p.grad.shape, generator=noise) * scale)
        lr = st.opt.param_groups[0]["lr"]
        st.opt.step()
        st.sched.step()
        logs.step(
            step, loss.item(), lr, samples=st.loader.samples, data_digest=digest_ids(ids), rng_digest=rng
        )
        if stale is not None and step == cfg.restored - STALE_STEPS:
            snapshot = copy.deepcopy(st.model)
        if stale is not None and step == cfg.restored - cfg.save_every:
            previous = copy.deepcopy(st.model)
        if stale is not None and stale_saved is not None and step == cfg.restored:
            # The async-save bugs: checkpoint N holds older weights (step N - STALE_STEPS, or the previous
            # checkpoint's), all else current; each copy is written aside for its branch.
            current = copy.deepcopy(st.model.state_dict())
            for old, where in ((snapshot, stale), (previous, stale_saved)):
                st.model.load_state_dict(old.state_dict())
                where.save(step, **st.as_dict())
            st.model.load_state_dict(current)
        if save and step % cfg.save_every == 0 and step in cfg.needed_saves:
            mgr.save(step, overwrite=True, **st.as_dict())
            mgr.wait()


@contextmanager
def _one_thread() -> Iterator[None]:
    """Tiny matrices: one intra-op thread is fastest, and keeps runs from fighting over shared cores."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _manager(run: Path, logs: Logs) -> CheckpointManager:
    return CheckpointManager(str(checkpoints_dir(run)), async_save=False, on_event=_saves_only(logs.ledger))


def _saves_only(ledger: LedgerWriter) -> Callable[[str, dict[str, Any]], None]:
    """The manager's save events go to the ledger; restores are logged by hand, with the optimizer counter."""
    return lambda kind, info: ledger.on_event(kind, info) if kind == "save" else None


def trunk(cfg: TruthConfig, root: Path) -> Path:
    """Session 1: train to the crash, checkpointing; also write the stale copy of checkpoint N aside
    (``root/stale``, ``root/stale_saved``), which the ``weights_stale*`` branches put in place of checkpoint N."""
    with _one_thread():
        return _trunk(cfg, root)


def _trunk(cfg: TruthConfig, root: Path) -> Path:
    run = root / "trunk"
    logs = Logs(run)
    mgr = _manager(run, logs)
    st = _build(cfg, init_seed=cfg.seed)
    stale = CheckpointManager(str(root / "stale"), async_save=False)
    stale_saved = CheckpointManager(str(root / "stale_saved"), async_save=False)
    _train(cfg, st, logs, mgr, 1, cfg.crash, stale=stale, stale_saved=stale_saved)
    stale.close()
    stale_saved.close()
    mgr.close()
    logs.crash()
    return run


def branch(cfg: TruthConfig, root: Path, defect: str) -> Path:
    """Copy the trunk and resume it with ``defect`` planted in the restore; returns the run directory."""
    if defect not in DEFECTS:
        raise ValueError(f"unknown defect {defect!r}; expected one of {', '.join(DEFECTS)}")
    run = root / defect
    if run.exists():
        shutil.rmtree(run)
    shutil.copytree(root / "trunk", run)
    n = cfg.restored
    if defect in ("weights_stale", "weights_stale_saved"):
        aside = root / ("stale" if defect == "weights_stale" else "stale_saved")
        target = Path(CheckpointManager(str(checkpoints_dir(run)), async_save=False).path_for(n))
        shutil.rmtree(target)
        shutil.copytree(Path(CheckpointManager(str(aside), async_save=False).path_for(n)), target)
    restarts = [(n, cfg.total)]
    if defect == "clean_two_restarts":
        n2 = n + cfg.save_every
        restarts = [(n, n2 + (OVERLAP_STEPS if cfg.overlap else 0)), (n2, cfg.total)]
    with _one_thread():
        for i, (from_step, last) in enumerate(restarts):
            _resume(cfg, run, defect, from_step, last, crash=i < len(restarts) - 1)
    return run


def _resume(cfg: TruthConfig, run: Path, defect: str, n: int, last: int, *, crash: bool) -> None:
    logs = Logs(run, deterministic=defect != "clean_nondeterministic")
    mgr = _manager(run, logs)
    torch.manual_seed(99_999)  # a fresh process: its own RNG until the restore replaces it
    st = _build(cfg, init_seed=cfg.seed + 7_777)  # a fresh init: everything must come from the checkpoint
    state = st.as_dict()
    restore_step = n - cfg.save_every if defect == "older_checkpoint" else n
    if defect == "scheduler_lost":
        state.pop("scheduler")
    if defect == "optimizer_reset":
        state.pop("optimizer")
    if defect == "data_reset":
        state.pop("dataloader")
    # Made before the restore (it draws from the RNG): the init a strict=False load that matched no key keeps.
    fresh = _model(cfg, init_seed=cfg.seed + 31_337).state_dict() if defect == "weights_fresh" else None
    mgr.restore(restore_step, rng=defect != "rng_lost", **state)
    rng_after = rng_digests()  # the live RNG as the restore left it (what the manager's restore event logs)
    if defect == "weights_fresh":  # load_state_dict(strict=False) that matched no key
        st.model.load_state_dict(fresh)
    elif defect == "lr_halved":  # a new config overwrote base_lrs after the restore
        st.sched.base_lrs = [b / 2 for b in st.sched.base_lrs]
    elif defect == "lr_off_by_one":  # the scheduler stepped once more while rebuilding
        st.sched.step()
    elif defect == "optimizer_reset":  # a fresh optimizer at the scheduler's LR
        for g in st.opt.param_groups:
            g["lr"] = st.sched.get_last_lr()[0]
    logs.ledger.restore(
        restore_step,
        mgr.path_for(restore_step),
        0.0,
        optimizer_step=optimizer_step(st.opt),
        rng_digests=rng_after,
    )
    noise = (
        torch.Generator().manual_seed(hash(run.name) % 2**31 + n)
        if defect == "clean_nondeterministic"
        else None
    )
    _train(cfg, st, logs, mgr, restore_step + 1, last, noise=noise)
    mgr.close()
    if crash:
        logs.crash()
    else:
        logs.tb.close()
        logs.ledger.close()


# ------------------------------------------------------------------------------------------- measuring
VIEWS = (
    ("tensorboard", 1, False),
    ("tensorboard", 5, False),
    ("tensorboard", 1, True),
    ("tensorboard", 5, True),
    ("ledger", 1, None),
    ("ledger", 5, None),
)
"""(format, log every k-th step, --deterministic): TensorBoard as a user logs it (no digests, no save
events, float32), in the default mode and with ``--deterministic``; the ledger in its default mode (the
sessions claim determinism, as this CPU run may) with the checkpoints' facts, as the CLI reads them."""
EFFECT_STEPS = 10


def thin(run: Run, every: int) -> Run:
    """The run as a logger that writes every ``every``-th step would have left it (events kept in place)."""
    if every == 1:
        return run
    sessions = []
    for s in run.sessions:
        keep = [r.step % every == 0 for r in s.steps]
        before = [sum(keep[:pos]) for pos in range(len(keep) + 1)]
        sessions.append(
            Session(
                s.id,
                [r for r, k in zip(s.steps, keep, strict=True) if k],
                list(s.events),
                [before[p] for p in s.event_positions],
                s.origin,
            )
        )
    return Run(run.path, run.source, sessions, run.precision, list(run.notes), run.sessions_logged)


def effect(clean: Path, broken: Path, restored: int) -> dict[str, float]:
    """How much the defect moved the resumed run against the clean branch on the same steps: the mean
    relative loss difference and the largest relative LR difference over the first ``EFFECT_STEPS`` steps."""
    a = {r.step: r for r in load_run(clean, "jsonl").sessions[-1].steps}
    b = {r.step: r for r in load_run(broken, "jsonl").sessions[1].steps}
    steps = [s for s in range(restored + 1, restored + 1 + EFFECT_STEPS) if s in a and s in b]
    if not steps:
        return {"loss": math.nan, "lr": math.nan}
    loss = sum((b[s].loss - a[s].loss) / abs(a[s].loss) for s in steps) / len(steps)  # type: ignore[operator]
    lr = max(abs(b[s].lr - a[s].lr) / abs(a[s].lr) for s in steps)  # type: ignore[operator]
    return {"loss": loss, "lr": lr}


def judge(run_dir: Path, fmt: str, every: int, deterministic: bool | None) -> dict[str, Any]:
    """What ``ckpt verify-resume`` says about one view of a branch: exit code and causes."""
    if fmt == "tensorboard":
        run, facts = load_run(run_dir / "tb", "tensorboard"), None
    else:
        run, facts = load_run(run_dir, "jsonl"), ManifestFacts(str(checkpoints_dir(run_dir)))
    result = verify_run(thin(run, every), options=VerifyOptions(deterministic=deterministic), facts=facts)
    causes = [c.value for c in result.causes]
    return {"exit": result.exit_code, "causes": causes, "cannot_tell": bool(result.undecided)}


def measure(
    cfg: TruthConfig, root: Path, defects: tuple[str, ...] = DEFECTS, views: tuple[Any, ...] = VIEWS
) -> list[dict[str, Any]]:
    """One trunk, every branch, every view (of ``views``): one row per (defect, view) with the verdict and the
    effect."""
    trunk(cfg, root)
    rows = []
    runs = {d: branch(cfg, root, d) for d in dict.fromkeys(("clean", *defects))}
    for d in defects:
        eff = effect(runs["clean"], runs[d], cfg.restored)
        for fmt, every, det in views:
            rows.append(
                {
                    "defect": d,
                    "size": cfg.size,
                    "seed": cfg.seed,
                    "overlap": cfg.overlap,
                    "restored": cfg.restored,
                    "format": fmt,
                    "every": every,
                    "deterministic": det,
                    "loss_effect": eff["loss"],
                    "lr_effect": eff["lr"],
                    **judge(runs[d], fmt, every, det),
                }
            )
    return rows
