"""The ledger writer: exact floats, whole lines only, a killed writer loses at most its last line."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt.resume.errors import RunInputError
from ckpt.resume.ledger import LedgerWriter, digest_ids, digest_rng, ledger_path
from ckpt.resume.model import Exit, Restore, Save, SessionStart
from ckpt.resume.sources import read_jsonl


def test_floats_round_trip_bit_for_bit(tmp_path: Path) -> None:
    rng = random.Random(0)
    values = [0.1 + 0.2, 5e-324, 1.7976931348623157e308, -0.0, math.pi, 1 / 3]
    values += [struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0] for _ in range(300)]
    values = [v for v in values if math.isfinite(v)]
    with LedgerWriter(tmp_path, deterministic=True) as w:
        for i, v in enumerate(values, start=1):
            w.step(i, v, torch.tensor(v, dtype=torch.float64), grad_norm=np.float64(v))
    run = read_jsonl(ledger_path(tmp_path))
    got = run.sessions[0].steps
    assert [struct.pack("<d", r.loss) for r in got] == [struct.pack("<d", v) for v in values]
    assert [r.lr for r in got] == values and [r.grad_norm for r in got] == values


def test_events_and_session_start_environment(tmp_path: Path) -> None:
    with LedgerWriter(tmp_path, world_size=8, deterministic=True, tokenizer_id="llama3@abc", seed=7) as w:
        w.restore(10, "ckpt/step-10", seconds=1.5)
        w.step(11, 1.0, 0.1, samples=88, tokens=1000, data_digest="d", rng_digest="r")
        w.compile(12.5, what="train graph")
        w.save(11, "ckpt/step-11", blocking_seconds=0.5, total_seconds=3.0)
    s = read_jsonl(ledger_path(tmp_path)).sessions[0]
    start = s.start
    assert isinstance(start, SessionStart)
    assert start.env["world_size"] == 8 and start.env["deterministic"] is True
    assert start.env["tokenizer_id"] == "llama3@abc" and start.env["seed"] == 7
    assert "hostname" in start.env and "torch" in start.env
    assert [type(e) for e in s.events] == [SessionStart, Restore, type(s.compiles[0]), Save, Exit]
    assert s.restores[0].seconds == 1.5 and s.saves[0].total_seconds == 3.0 and s.exit.clean
    assert s.steps[0].samples == 88 and s.steps[0].data_digest == "d"


def test_exit_marks_an_exception(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), LedgerWriter(tmp_path) as w:
        w.step(1, 1.0, 0.1)
        raise RuntimeError("boom")
    assert read_jsonl(ledger_path(tmp_path)).sessions[0].exit.clean is False


def test_disabled_writer_writes_nothing(tmp_path: Path) -> None:
    w = LedgerWriter(tmp_path, enabled=False)
    w.step(1, 1.0, 0.1)
    w.save(1, "x")
    w.close()
    assert not ledger_path(tmp_path).exists()


def test_buffered_lines_are_written_whole(tmp_path: Path) -> None:
    w = LedgerWriter(tmp_path, buffer_lines=4)
    for i in range(1, 4):
        w.step(i, 1.0, 0.1)
    assert ledger_path(tmp_path).read_text().count("\n") == 1  # only session_start so far
    w.step(4, 1.0, 0.1)
    assert ledger_path(tmp_path).read_text().count("\n") == 5
    w.close()


def test_sigkill_leaves_only_complete_lines(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal
        from ckpt.resume.ledger import LedgerWriter
        w = LedgerWriter({str(tmp_path)!r})
        for i in range(1, 101):
            w.step(i, 1.0 / i, 0.1)
            if i == 57:
                os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], check=False)
    assert proc.returncode == -signal.SIGKILL
    data = ledger_path(tmp_path).read_bytes()
    assert data.endswith(b"\n")
    run = read_jsonl(ledger_path(tmp_path))
    assert [r.step for r in run.sessions[0].steps] == list(range(1, 58))
    assert run.sessions[0].exit is None


def test_torn_tail_is_skipped_and_repaired_by_the_next_session(tmp_path: Path) -> None:
    with LedgerWriter(tmp_path) as w:
        w.step(1, 1.0, 0.1)
    path = ledger_path(tmp_path)
    with open(path, "ab") as fh:
        fh.write(b'{"kind":"step","step":2,"lo')  # power loss mid-line
    run = read_jsonl(path)
    assert [r.step for r in run.sessions[0].steps] == [1] and "torn" in run.notes[0]
    with LedgerWriter(tmp_path) as w:  # the next session ends the torn line before writing
        w.restore(1, "c")
        w.step(2, 1.0, 0.1)
    run = read_jsonl(path)
    assert [len(s.steps) for s in run.sessions] == [1, 1] and any("torn" in n for n in run.notes)


def test_malformed_line_names_its_number(tmp_path: Path) -> None:
    with LedgerWriter(tmp_path) as w:
        w.step(1, 1.0, 0.1)
    path = ledger_path(tmp_path)
    lines = path.read_text().splitlines()
    lines.insert(2, "not json")
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RunInputError, match=r"ledger.jsonl:3: malformed"):
        read_jsonl(path)
    path.write_text(json.dumps({"kind": "step", "step": "x", "session": "s"}) + "\n")
    with pytest.raises(RunInputError, match=r":1: bad 'step' record"):
        read_jsonl(path)


def test_empty_ledger_is_bad_input(tmp_path: Path) -> None:
    ledger_path(tmp_path).write_text("")
    with pytest.raises(RunInputError, match="no step records"):
        read_jsonl(ledger_path(tmp_path))


def test_digest_ids_is_stable_across_containers_and_order_sensitive() -> None:
    ids = [5, 3, 99, 1024]
    d = digest_ids(ids)
    assert (
        d
        == digest_ids(torch.tensor(ids))
        == digest_ids(np.array(ids, dtype=np.int32))
        == digest_ids(tuple(ids))
    )
    assert d != digest_ids([3, 5, 99, 1024])
    assert len(d) == 16 and digest_ids(["a", "b"]) != digest_ids(["b", "a"])


def test_digest_rng_follows_every_stream() -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    base = digest_rng()
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    for draw in (random.random, np.random.rand, torch.rand):
        draw(1) if draw is not random.random else draw()
        assert digest_rng() != base
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        assert digest_rng() == base


def test_o_append_keeps_sessions_in_one_file(tmp_path: Path) -> None:
    for k in range(3):
        with LedgerWriter(tmp_path) as w:
            w.step(k + 1, 1.0, 0.1)
    run = read_jsonl(ledger_path(tmp_path))
    assert len(run.sessions) == 3 and len({s.id for s in run.sessions}) == 3
    assert os.path.getsize(ledger_path(tmp_path)) > 0
