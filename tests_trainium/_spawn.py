"""Run a function in N fresh spawned processes, each in a gloo group (127.0.0.1, a free port); the values come back
in rank order, a child's exception fails the test with its traceback.  (The main suite's ``run_ranks`` lives in
``tests/conftest.py``, a module name this environment's own conftest takes.)"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HERE = str(Path(__file__).resolve().parent)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, out: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            buf = (
                io.BytesIO()
            )  # bytes, not tensors: torch would share their memory with a process about to exit
            torch.save(fn(rank, world, *args), buf)
            out.put((rank, True, buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """``fn(rank, world, *args)`` in ``world`` processes (``fn`` module-level, in a module of this folder)."""
    path = os.environ.get("PYTHONPATH", "")
    if HERE not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, path]))
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, port, args, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                failures.append(f"timed out after {timeout}s waiting for the ranks")
                break
            if ok:
                import torch

                got[rank] = torch.load(io.BytesIO(value), weights_only=True)
            else:
                failures.append(f"--- rank {rank} raised:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=10 if not failures else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    return [got[r] for r in range(world)]
