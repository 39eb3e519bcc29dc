"""Checkpoint facts read from real manifests, the tokenizer id format, and the manager-event adapter."""

from __future__ import annotations

import threading
from importlib.metadata import version
from pathlib import Path

import torch

import ckpt
from ckpt.resume.checks import Cause
from ckpt.resume.checks.steps import _tokenizer_differs
from ckpt.resume.ledger import LedgerWriter, ledger_path, tokenizer_id
from ckpt.resume.manifest_facts import ManifestFacts
from ckpt.resume.sources import read_jsonl


def _trained(steps: int, clear_optimizer: bool = False):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    for _ in range(steps):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
    if clear_optimizer:
        opt.state.clear()
    return model, opt, sched


def test_facts_come_from_the_manifest(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "vocab.json").write_text('{"a": 0}')
    model, opt, sched = _trained(7)
    root = tmp_path / "checkpoints"
    ckpt.save(
        str(root / "step_00000007"),
        step=7,
        model=model,
        optimizer=opt,
        scheduler=sched,
        tokenizer=str(tok),
        progress={"samples": 56},
    )
    provider = ManifestFacts(root)
    f = provider(7, None)
    assert f is not None and f.step == 7
    assert f.optimizer_steps == {"weight": 7, "bias": 7}
    assert f.scheduler_last_epoch == 7 and f.samples == 56
    assert f.tokenizer_id == tokenizer_id(str(tok)) and f.env["torch"] == version("torch")
    # A moved run: the logged path no longer exists, the folder name under the root still does.
    assert provider(7, "/elsewhere/checkpoints/step_00000007") == f
    assert provider(8, None) is None and "no readable checkpoint of step 8" in provider.notes[-1]


def test_tokenizer_ids_compare_by_hash_or_as_free_text() -> None:
    assert not _tokenizer_differs("tok@0123456789abcdef", "other-name@0123456789abcdef")
    assert _tokenizer_differs("tok@0123456789abcdef", "tok@fedcba9876543210")
    assert _tokenizer_differs("tok@1", "tok@2")
    assert not _tokenizer_differs("tok@0123456789abcdef", "llama3@v1")  # not comparable: no false alarm
    assert Cause.TOKENIZER_CHANGED.value == "tokenizer changed"


def test_manager_events_reach_the_ledger_from_the_writer_thread(tmp_path: Path) -> None:
    model, opt, sched = _trained(1)
    with LedgerWriter(tmp_path, deterministic=True) as ledger:
        mgr = ckpt.CheckpointManager(str(tmp_path / "checkpoints"), async_save=True, on_event=ledger.on_event)
        stop = threading.Event()

        def spam() -> None:  # step records written while async commits arrive on another thread
            i = 0
            while not stop.is_set():
                i += 1
                ledger.step(i, 1.0, 0.1)

        t = threading.Thread(target=spam)
        t.start()
        for step in (1, 2, 3):
            mgr.save(step, model=model, optimizer=opt, scheduler=sched)
        mgr.restore(2, model=model, optimizer=opt, scheduler=sched)
        mgr.close()
        stop.set()
        t.join()
    run = read_jsonl(ledger_path(tmp_path))  # every line parses: no interleaved writes
    (session,) = run.sessions
    assert [s.step for s in session.saves] == [1, 2, 3]
    assert all(s.bytes and s.total_seconds >= s.blocking_seconds for s in session.saves)
    (restore,) = session.restores
    assert restore.step == 2 and restore.seconds is not None and restore.path.endswith("step_00000002")
