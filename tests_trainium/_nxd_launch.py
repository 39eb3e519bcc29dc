"""Start rank processes the way ``torchrun`` would, with NxD's own code importable: one gloo group on 127.0.0.1,
``PYTHONPATH`` = ``.venv-trainium/nxd-site`` (``nxd-site-requirements.txt``), ``tests/nxd_shim``, NxD's ``src/``,
this folder, the repository root.  A failed rank fails the calling test with its log's tail."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import conftest
import pytest

HERE = Path(__file__).resolve().parent
SITE = conftest.ROOT / ".venv-trainium" / "nxd-site"
# XLA CPU compiles each graph with LLVM; the cheapest level keeps each process's arithmetic deterministic
XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def site_env() -> dict[str, str]:
    """The environment of a process that imports NxD's trainer or example model (``SITE`` first on the path)."""
    if not (SITE / "transformers").is_dir() or not (SITE / "boto3").is_dir():
        pytest.fail(
            f"{SITE} is missing: .venv-trainium/bin/pip install --no-deps --target {SITE} "
            f"-r {HERE / 'nxd-site-requirements.txt'} (.ci/trainium-stack does)",
            pytrace=False,
        )
    path = [SITE, conftest.SHIM, conftest.NXD_SRC, HERE, conftest.ROOT]
    return dict(
        os.environ, NXD_CPU_MODE="1", NXD_SRC=str(conftest.NXD_SRC), PJRT_DEVICE="CPU", XLA_FLAGS=XLA_FLAGS,
        PYTHONPATH=os.pathsep.join(str(p) for p in path),
    )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, job: dict, tmp: Path, ranks: int, timeout: float = 240) -> None:
    """``python <script> <tmp>/job.json`` in ``ranks`` fresh processes joined in one gloo group."""
    (tmp / "job.json").write_text(json.dumps(job))
    env = dict(
        site_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(ranks),
        GLOO_SOCKET_IFNAME="lo",
    )  # fmt: skip
    procs = []
    for r in range(ranks):
        log = open(tmp / f"rank{r}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, str(HERE / script), str(tmp / "job.json")]
        procs.append(
            (subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stdout=log, stderr=subprocess.STDOUT), log)
        )
    failed = []
    try:
        for r, (p, _) in enumerate(procs):
            if p.wait(timeout=timeout) != 0:
                failed.append(r)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    if failed:
        tails = "\n".join(f"--- rank {r}:\n{(tmp / f'rank{r}.log').read_text()[-4000:]}" for r in failed)
        pytest.fail(f"rank processes {failed} of {script} failed:\n{tails}", pytrace=False)
