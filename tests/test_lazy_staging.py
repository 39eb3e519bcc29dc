"""Lazy staging: an async ``save()`` returns before copying the optimizer's tensors, and the saved bytes are still
exactly the state at ``save()`` time however soon training mutates it (as soon as the contract allows: the
optimizer step right away, guarded by the step pre-hook; other edits after ``staged()``).

Every test takes sha256 digests of every saved tensor inside the ``save()`` call's moment (before any mutation),
mutates every tensor, then reads the committed checkpoint back and compares bytes.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt
from ckpt import SaveOptions
from ckpt.format.reader import CheckpointReader
from ckpt.saving.checkpointer import Checkpointer
from ckpt.saving.staging import HostStager
from ckpt.state.training import optim_name

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.register_buffer("count", torch.zeros(3))  # mutated outside any optimizer: staged eagerly

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def make(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = Net()
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


def backward(m: nn.Module, seed: int) -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
    m(x).pow(2).mean().backward()


def train_step(m: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    opt.zero_grad()
    backward(m, seed)
    opt.step()


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def digests(m: nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """sha256 of every tensor a save writes, by its checkpoint name (taken before anything mutates them)."""
    out = {n: sha(t) for n, t in m.state_dict().items()}
    names = {id(p): n for n, p in m.named_parameters()}
    for p, st_ in opt.state.items():
        for k, v in st_.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[optim_name(names[id(p)], k)] = sha(v)
    return out


def saved_digests(path: str) -> dict[str, str]:
    r = CheckpointReader(path)
    return {n: sha(r.read(n)) for n in r.names()}


def mutate_everything(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    """In-place edits of every saved tensor outside a step (the caller has called staged() first)."""
    with torch.no_grad():
        for t in m.state_dict().values():
            t.add_(1.0)
        for st_ in opt.state.values():
            for v in st_.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    v.mul_(-3.0)


class GatedStager(HostStager):
    """The real HostStager whose background copy starts only when the test opens the gate: proves the hooks wait
    (a copy that is fast enough would pass a test whose hooks do nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.started = threading.Event()

    def copy_background(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.started.set()
        self.gate.wait(timeout=60)
        super().copy_background(pairs)


def blocked(fn: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, errors


def test_step_right_after_save_waits_for_the_copy_and_saved_bytes_are_save_time(tmp_path: Path) -> None:
    m, opt = make()
    train_step(m, opt, 0)
    stager = GatedStager()
    ck = Checkpointer(async_save=True, stager=stager)
    want = digests(m, opt)
    ck.save(str(tmp_path / "s1"), step=1, model=m, optimizer=opt, options=SaveOptions(rng=False))
    info = ck.last_staging
    assert info is not None and info.lazy_bytes > 0
    assert info.eager_bytes == 3 * 4 and "not owned by the optimizer" in (info.reason or "")
    with torch.no_grad():
        m.count.add_(7.0)  # the buffer was copied before save() returned: editable at once
    opt.zero_grad()
    backward(m, 1)  # forward and backward overlap the copy: no wait
    assert stager.started.wait(10) and ck._staged is not None and ck._staged.pending
    th, errors = blocked(opt.step)
    th.join(0.3)
    assert th.is_alive(), "optimizer.step() ran while the lazy copy had not read its tensors"
    stager.gate.set()
    th.join(30)
    assert not th.is_alive() and not errors
    ck.staged()
    mutate_everything(m, opt)
    ck.close()
    assert saved_digests(str(tmp_path / "s1")) == want


def test_load_state_dict_into_the_model_waits_for_the_copy(tmp_path: Path) -> None:
    m, opt = make()
    train_step(m, opt, 0)
    other, _ = make(seed=5)
    stager = GatedStager()
    ck = Checkpointer(async_save=True, stager=stager)
    want = digests(m, opt)
    ck.save(str(tmp_path / "s"), step=1, model=m, optimizer=opt, options=SaveOptions(rng=False))
    th, errors = blocked(lambda: m.load_state_dict(other.state_dict()))
    th.join(0.3)
    assert th.is_alive(), "load_state_dict overwrote parameters the lazy copy had not read"
    stager.gate.set()
    th.join(30)
    assert not errors
    ck.close()
    assert saved_digests(str(tmp_path / "s")) == want


def test_grad_scaler_step_is_guarded(tmp_path: Path) -> None:
    """GradScaler.step calls optimizer.step (the hooked call); its own scale is captured as a value in save()."""
    m, opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for i in range(2):
        opt.zero_grad()
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i))
        scaler.scale(m(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
    ck = Checkpointer(async_save=True)
    want = digests(m, opt)
    ck.save(
        str(tmp_path / "s"), step=2, model=m, optimizer=opt, scaler=scaler, options=SaveOptions(rng=False)
    )
    assert ck.last_staging is not None and ck.last_staging.lazy_bytes > 0
    opt.zero_grad()
    scaler.scale(m(torch.ones(5, 8)).pow(2).mean()).backward()
    scaler.step(opt)  # right away: the hook holds it until the copy read the tensors
    scaler.update()
    ck.staged()
    mutate_everything(m, opt)
    ck.close()
    assert saved_digests(str(tmp_path / "s")) == want


def test_without_an_optimizer_or_with_lazy_false_everything_is_copied_before_returning(
    tmp_path: Path,
) -> None:
    m, opt = make()
    train_step(m, opt, 0)
    ck = Checkpointer(async_save=True)
    want = digests(m, opt)
    ck.save(str(tmp_path / "a"), step=1, model=m, options=SaveOptions(rng=False))
    assert ck.last_staging is not None and ck.last_staging.lazy_bytes == 0
    assert "no optimizer" in (ck.last_staging.reason or "")
    mutate_everything(m, opt)  # no staged() needed: nothing was left to copy
    ck.wait()
    want_after = digests(m, opt)
    ck.save(str(tmp_path / "b"), step=2, model=m, optimizer=opt, options=SaveOptions(rng=False, lazy=False))
    assert ck.last_staging.lazy_bytes == 0 and "lazy" in (ck.last_staging.reason or "")
    mutate_everything(m, opt)
    ck.close()
    got = saved_digests(str(tmp_path / "a"))
    assert got == {k: v for k, v in want.items() if k in got} and len(got) == 5
    assert saved_digests(str(tmp_path / "b")) == want_after


class Wrapper(torch.optim.Optimizer):
    """An optimizer wrapper that delegates to an inner optimizer without calling Optimizer.__init__ (as some
    framework wrappers do): it accepts register_step_pre_hook, but its step() never runs the hooks."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    @property
    def param_groups(self) -> list:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    def state_dict(self) -> dict:  # type: ignore[override]
        return self.inner.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.inner.step()


def test_a_wrapper_whose_step_runs_no_hooks_is_staged_eagerly(tmp_path: Path) -> None:
    m, inner = make()
    opt = Wrapper(inner)
    train_step(m, opt, 0)
    ck = Checkpointer(async_save=True)
    want = digests(m, inner)
    ck.save(str(tmp_path / "s"), step=1, model=m, optimizer=opt, options=SaveOptions(rng=False))
    assert ck.last_staging is not None and ck.last_staging.lazy_bytes == 0
    assert "does not run step hooks" in (ck.last_staging.reason or "")
    train_step(m, opt, 1)  # would race a lazy copy: no hook runs
    mutate_everything(m, inner)
    ck.close()
    assert saved_digests(str(tmp_path / "s")) == want


def test_manager_restore_waits_for_the_in_flight_copy(tmp_path: Path) -> None:
    m, opt = make()
    train_step(m, opt, 0)
    mgr = ckpt.CheckpointManager(str(tmp_path / "run"), async_save=True)
    mgr.save(1, model=m, optimizer=opt, rng=False)
    mgr.wait()
    train_step(m, opt, 1)
    want = digests(m, opt)
    mgr.save(2, model=m, optimizer=opt, rng=False)
    mgr.restore(1, model=m, optimizer=opt, rng=False)  # overwrites in place: must wait for save 2's copy
    mgr.close()
    assert saved_digests(str(tmp_path / "run" / "step_00000002")) == want


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.sampled_from(["save", "step", "edit", "wait", "forward"]), min_size=3, max_size=12))
def test_interleaved_saves_steps_and_edits_keep_save_time_bytes(
    tmp_path_factory: Any, ops: list[str]
) -> None:
    root = tmp_path_factory.mktemp("inter")
    m, opt = make()
    train_step(m, opt, 0)
    ck = Checkpointer(async_save=True)
    expected: dict[str, dict[str, str]] = {}
    for i, op in enumerate(ops):
        if op == "save":
            path = str(root / f"s{i}")
            expected[path] = digests(m, opt)
            ck.save(path, step=i, model=m, optimizer=opt, options=SaveOptions(rng=False))
        elif op == "step":
            train_step(m, opt, i)  # no explicit wait: the step pre-hook guards it
        elif op == "edit":
            ck.staged()  # the contract for edits outside a step
            mutate_everything(m, opt)
        elif op == "forward":
            opt.zero_grad()
            backward(m, i)
        else:
            ck.wait()
    ck.close()
    for path, want in expected.items():
        assert saved_digests(path) == want, path
