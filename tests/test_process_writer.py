"""The persistent writer process (ckpt.saving.process_writer): same bytes as the in-process writer, the same
isolation from the next step, and the same crash semantics: a killed writer fails the save (nothing committed)
and is replaced for the next one; a killed trainer takes its writer with it; close() stops it."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from torture.crash import exited

import ckpt
from ckpt.errors import AsyncSaveError
from ckpt.format.datafile import Chunk, write_shard_file
from ckpt.format.manifest import MANIFEST_NAME
from ckpt.format.streamwrite import HASH_WRITE_BLOCK
from ckpt.saving.checkpointer import Checkpointer
from ckpt.saving.options import SaveOptions
from ckpt.saving.process_writer import ProcessStager
from ckpt.saving.staging import HostStager

NO_RNG = SaveOptions(rng=False)

pytestmark = pytest.mark.timeout(120)
HERE = Path(__file__).parent


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model, opt)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()


def data_files(path: Path) -> dict[str, bytes]:
    return {f.name.split("-")[0]: f.read_bytes() for f in path.iterdir() if f.name.endswith(".safetensors")}


def test_same_bytes_as_the_in_process_writer_and_isolated_from_the_next_step(tmp_path: Path) -> None:
    model, opt = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = Checkpointer(async_save=True, stager=HostStager())
    plain.save(str(tmp_path / "thread"), step=1, model=model, optimizer=opt, options=NO_RNG).result()
    proc = Checkpointer(async_save=True, stager=ProcessStager())
    fut = proc.save(str(tmp_path / "process"), step=1, model=model, optimizer=opt, options=NO_RNG)
    step(model, opt)  # right after save(): the step hook waits for the copy, the writer reads the arena
    fut.result()
    pid = proc.stager.writer_pid
    assert pid is not None and pid != os.getpid()  # written by the writer process, not by this one
    assert data_files(tmp_path / "process") == data_files(tmp_path / "thread")
    m2, o2 = make()
    ckpt.restore(str(tmp_path / "process"), model=m2, optimizer=o2, rng=False)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, before[k]), k
    proc.save(str(tmp_path / "again"), step=2, model=model, optimizer=opt, options=NO_RNG).result()
    assert proc.stager.writer_pid == pid  # one persistent process
    proc.close()
    plain.close()
    assert exited(pid, 20)


def test_a_killed_writer_fails_the_save_commits_nothing_and_is_replaced(tmp_path: Path) -> None:
    model, opt = make()
    ck = Checkpointer(async_save=True, stager=ProcessStager())
    ck.save(str(tmp_path / "s1"), step=1, model=model, optimizer=opt, options=NO_RNG).result()
    pid = ck.stager.writer_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # it cannot start the next job ...
    fut = ck.save(str(tmp_path / "s2"), step=2, model=model, optimizer=opt, options=NO_RNG)
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)  # ... and dies with it handed over
    with pytest.raises(AsyncSaveError, match="writer process"):
        ck.wait()
    assert fut.done()
    assert not (tmp_path / "s2" / MANIFEST_NAME).exists()
    s2 = tmp_path / "s2"
    assert not s2.exists() or not any(f.name.endswith(".safetensors") for f in s2.iterdir())
    ck.save(str(tmp_path / "s3"), step=3, model=model, optimizer=opt, options=NO_RNG).result()
    assert ck.stager.writer_pid not in (None, pid)
    assert (tmp_path / "s3" / MANIFEST_NAME).exists()
    ck.close()


@pytest.mark.parametrize("fork", [False, True])
def test_the_writer_dies_with_a_killed_trainer(tmp_path: Path, fork: bool) -> None:
    trainer = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "_process_writer_trainer.py"),
            str(tmp_path),
            *(["fork"] if fork else []),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None and trainer.stdin is not None
        writer = int(trainer.stdout.readline())
        worker = int(trainer.stdout.readline()) if fork else None
        assert not exited(writer, 0)
        os.kill(writer, signal.SIGSTOP)  # the second save is handed over but cannot finish before the kill
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        assert trainer.stdout.readline().strip() == "saving"
        trainer.kill()
        trainer.wait(30)
        os.kill(writer, signal.SIGCONT)
        assert exited(writer, 20), "the writer process outlived its trainer"
        assert worker is None or not exited(worker, 0)  # the forked worker still runs: it held no lifeline
    finally:
        trainer.kill()
        if fork and worker is not None and not exited(worker, 0):
            os.kill(worker, signal.SIGKILL)
    assert (tmp_path / "step1" / MANIFEST_NAME).exists()
    assert not (tmp_path / "step2" / MANIFEST_NAME).exists()
    # it died mid-job (its lifeline), not after finishing the file it had been handed (its input's EOF)
    step2 = tmp_path / "step2"
    assert not step2.exists() or not any(f.name.endswith(".safetensors") for f in step2.iterdir())


def test_what_the_arena_cannot_serve_is_written_in_process(tmp_path: Path) -> None:
    model, opt = make()
    ck = Checkpointer(async_save=True, stager=ProcessStager(), codec="zstd")
    ck.save(str(tmp_path / "z"), step=1, model=model, optimizer=opt, options=NO_RNG).result()
    (blob,) = data_files(tmp_path / "z").values()
    header = json.loads(blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]])
    # compressed chunks (U8 entries), which only the in-process writer writes
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"U8"}
    m2, o2 = make()
    step(m2, o2)
    ckpt.restore(str(tmp_path / "z"), model=m2, optimizer=o2, rng=False)
    for (k, v), w in zip(m2.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    ck.close()


def test_a_chunk_hashed_block_by_block_has_the_checksum_of_its_bytes(tmp_path: Path) -> None:
    t = torch.arange(HASH_WRITE_BLOCK // 4 * 2 + 5, dtype=torch.float32)  # two blocks and a tail
    with open(tmp_path / "f", "wb") as f:
        (w,), size = write_shard_file(f, [Chunk("t@0", t)])
    raw = (tmp_path / "f").read_bytes()
    assert size == len(raw) and raw[w.offset :] == t.numpy().tobytes()
    assert w.checksum == f"xxh3_64:{xxhash.xxh3_64_hexdigest(t.numpy().tobytes())}"


def test_async_saves_write_through_a_writer_process_by_default_and_sync_saves_never_do(tmp_path: Path) -> None:
    model, opt = make()
    mgr = ckpt.CheckpointManager(str(tmp_path / "run"))  # async by default
    stager = mgr.checkpointer.stager
    assert isinstance(stager, ProcessStager) and stager.writer_pid is None  # nothing started before a write
    mgr.save(1, model=model, optimizer=opt)
    mgr.wait()
    pid = stager.writer_pid
    assert pid is not None and pid != os.getpid()
    step(model, opt)
    mgr.save(2, model=model, optimizer=opt)
    mgr.wait()
    assert stager.writer_pid == pid  # one persistent writer, not one per save
    restored, ropt = make()
    assert mgr.restore_latest(model=restored, optimizer=ropt) == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, restored.state_dict()[k]), k
    mgr.close()
    assert exited(pid, 10)
    sync = Checkpointer()
    assert type(sync.stager) is HostStager


def test_a_save_to_object_storage_starts_no_writer_process(s3: Any) -> None:
    model, opt = make()
    ck = Checkpointer(async_save=True, storage_options=s3.storage_options)
    ck.save(f"{s3.url}/step_1", step=1, model=model, optimizer=opt, options=NO_RNG).result()
    assert isinstance(ck.stager, ProcessStager) and ck.stager.writer_pid is None
    out, oopt = make()
    ckpt.restore(f"{s3.url}/step_1", model=out, optimizer=oopt, storage_options=s3.storage_options)
    for k, v in model.state_dict().items():
        assert torch.equal(v, out.state_dict()[k]), k
    ck.close()


def test_a_hung_writer_fails_the_save_within_its_timeout_naming_the_writer(tmp_path: Path) -> None:
    """A writer that stops answering (here: stopped with SIGSTOP, as a hung child looks) is killed after
    ``writer_timeout_s``: the save fails naming it, nothing is committed, the next save gets a new writer."""
    model, opt = make()
    ck = Checkpointer(async_save=True, stager=ProcessStager(writer_timeout_s=1.0))
    ck.save(str(tmp_path / "s1"), step=1, model=model, optimizer=opt, options=NO_RNG).result()
    pid = ck.stager.writer_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        ck.save(str(tmp_path / "s2"), step=2, model=model, optimizer=opt, options=NO_RNG)
        with pytest.raises(AsyncSaveError, match=rf"writer process {pid} gave no answer within 1 s .*killed"):
            ck.wait()
    finally:
        if not exited(pid, 0):
            os.kill(pid, signal.SIGKILL)
    assert exited(pid, 10)
    assert not (tmp_path / "s2" / MANIFEST_NAME).exists()
    ck.save(str(tmp_path / "s3"), step=3, model=model, optimizer=opt, options=NO_RNG).result()
    assert ck.stager.writer_pid not in (None, pid)
    assert (tmp_path / "s3" / MANIFEST_NAME).exists()
    ck.close()
