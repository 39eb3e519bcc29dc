"""The device a run is labelled with comes from evidence of use, not from what torch was built with.

The default Linux torch wheel is a CUDA build (``torch.version.cuda`` is set on a machine without a GPU),
and the ledger records that version as ``cuda``.  A CPU run on gloo ranks was labelled ``cuda 12.8`` by
``ckpt compare`` because of it (issue 18).  Here a real gloo process group writes a real ledger, and the
record it leaves is labelled ``cpu``; a record with no evidence says the device was not logged.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ckpt.resume.compare import compare_runs
from ckpt.resume.environment import UNKNOWN_DEVICE, backend, env_differences, env_summary, last_env
from ckpt.resume.ledger import LedgerWriter
from ckpt.resume.sources import load_run

DEMO_RECORD = {
    "hostname": "vm",
    "python": "3.11.7",
    "pid": 11556,
    "torch": "2.9.0",
    "torch_xla": "2.9.0",
    "cuda": "12.8",
    "torch_deterministic_algorithms": False,
    "world_size": 2,
    "deterministic": True,
    "seed": 1234,
}
"""The ``env`` of a ``ckpt demo`` ledger (2 gloo ranks on a CPU-only machine with the CUDA wheel of torch),
as the writer recorded it before it logged the process group's backend."""


def _train(run_dir: Path, steps: int = 8) -> None:
    with LedgerWriter(run_dir, deterministic=True) as ledger:
        for step in range(1, steps + 1):
            ledger.step(step, torch.tensor(2.0 / step), 1e-3)


@pytest.fixture()
def gloo_group(tmp_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_gloo_run_is_labelled_cpu_whatever_torch_was_built_with(tmp_path: Path, gloo_group: None) -> None:
    _train(tmp_path / "run")
    env = last_env(load_run(tmp_path / "run"))
    assert env["dist_backend"] == "gloo"
    assert env.get("cuda") == torch.version.cuda  # the CUDA build is still recorded, as a version
    assert backend(env) == "cpu"
    summary = env_summary(env)
    assert summary.startswith(f"cpu torch {env['torch']}") and "cuda" not in summary


def test_a_record_without_evidence_of_the_device_says_so() -> None:
    assert backend(DEMO_RECORD) == UNKNOWN_DEVICE
    summary = env_summary(DEMO_RECORD)
    assert "cuda" not in summary and "cpu" not in summary
    assert summary == f"torch 2.9.0 torch-xla 2.9.0 world 2, {UNKNOWN_DEVICE}"
    assert env_summary({"python": "3.11.7"}) == UNKNOWN_DEVICE and env_summary({}) == "not logged"


@pytest.mark.parametrize(
    "evidence, label",
    [
        ({"dist_backend": "nccl"}, "cuda 12.8 torch 2.9.0"),  # NCCL runs on CUDA tensors only
        ({"dist_backend": "xla"}, "xla torch 2.9.0"),
        ({"backend": "neuron"}, "neuron torch 2.9.0"),  # what the run says of itself wins
        ({"device": "cpu", "dist_backend": "nccl"}, "cpu torch 2.9.0"),
        ({"neuronx_cc": "2.21.0"}, "neuron torch 2.9.0"),  # the Neuron compiler exists only on Neuron hosts
    ],
)
def test_evidence_of_the_device(evidence: dict[str, object], label: str) -> None:
    assert env_summary({**DEMO_RECORD, **evidence}).startswith(label)


def test_compare_names_a_cpu_run_against_a_gpu_run(tmp_path: Path, gloo_group: None) -> None:
    _train(tmp_path / "cpu")
    gpu_env = {**DEMO_RECORD, "dist_backend": "nccl", "world_size": 1}
    with LedgerWriter(tmp_path / "gpu", deterministic=True, extra_env=gpu_env) as ledger:
        for step in range(1, 9):
            ledger.step(step, torch.tensor(2.0 / step), 1e-3)
    c = compare_runs(load_run(tmp_path / "cpu"), load_run(tmp_path / "gpu"), labels=("cpu", "gpu"))
    doc = c.to_json()["environment"]
    assert doc["a"].startswith("cpu torch") and doc["b"].startswith("cuda 12.8 torch")
    assert ("dist_backend", "gloo", "nccl") in env_differences(c.a.env, c.b.env)
    assert c.loss.bitwise_equal  # same values: only the machines differ
