"""Framework RNG streams plug into ckpt.state.rng: a registered stream is captured, restored and re-derived across a
DP change like the built-in generators, and a process without torch_xla loads no Neuron code to save its RNG."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from typing import Any

import pytest

from ckpt.format import treecodec
from ckpt.state import rng


class SeededStream:
    """A framework's own generator (a private ``random.Random``), as an :class:`ckpt.state.rng.RngStream`."""

    keys = ("demo",)

    def __init__(self) -> None:
        self.gen = random.Random(5)

    def capture(self) -> dict[str, Any]:
        return {"demo": list(self.gen.getstate()[1])}

    def restore(self, state: dict[str, Any]) -> list[str]:
        self.gen.setstate((3, tuple(int(x) for x in state["demo"]), None))
        return ["demo"]

    def reseed(self, key: str, seed: int) -> bool:
        self.gen.seed(seed)
        return True


@pytest.fixture
def stream() -> Any:
    s = SeededStream()
    rng.register(s)
    yield s
    rng._STREAMS.remove(s)


def test_registered_stream_is_captured_and_restored(stream: SeededStream) -> None:
    saved = rng.capture()
    want = [stream.gen.random() for _ in range(3)]
    stream.gen.seed(99)
    assert "demo" in rng.restore(saved)
    assert [stream.gen.random() for _ in range(3)] == want


def test_registered_stream_is_rederived_on_another_dp_size(stream: SeededStream) -> None:
    # two saving ranks whose demo streams differ: on one rank the stream is re-derived from the base seed
    records = {}
    for r in range(2):
        stream.gen.seed(r)
        records[str(r)] = rng.capture()
    carried, derived = rng.restore_across(records, None, step=7, rank=0, world=1)
    assert "demo" in derived and "demo" not in carried
    after = stream.gen.random()
    rng.restore_across(records, None, step=7, rank=0, world=1)
    assert stream.gen.random() == after  # the same checkpoint on the same DP size derives the same stream


def test_an_unknown_key_is_neither_restored_nor_reseeded() -> None:
    encoded = treecodec.encode({"python": random.getstate(), "mystery": 3}, "rng")
    assert rng.restore(encoded) == ["python"]
    assert rng._seed_stream("mystery", 1) is False


def test_capture_without_torch_xla_loads_no_neuron_code() -> None:
    code = (
        "import sys\nfrom ckpt.state import rng\nrec = rng.capture()\n"
        "assert 'torch_xla' not in sys.modules and 'ckpt.neuron' not in sys.modules, sorted(sys.modules)\n"
        "assert not any(k.startswith('xla') for k in rec), rec\nprint('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=300
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
