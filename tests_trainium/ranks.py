"""``run_ranks``: a function in several fresh processes joined in one gloo group, its values (tensors, dicts, lists,
strings) sent back as ``torch.save`` bytes (``tests/conftest.py`` has the
main suite's; this environment's ``conftest`` module is ``tests_trainium/conftest.py``, so the spawned children
import this module instead).  The children inherit ``PYTHONPATH`` (NxD's source, the shim) from ``conftest``, and
this folder, so that they import the rank bodies' modules."""

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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], results: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo")  # fmt: skip
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            value = fn(rank, world, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        buf = io.BytesIO()  # tensors as bytes: a queue would share their storage by a descriptor of a child that exits
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - sent to the parent, which fails the test with it
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """``fn(rank, world, *args)`` (a module-level function) in ``world`` processes; the values in rank order.
    A child's exception fails the test with its traceback; a hung child fails it after ``timeout`` seconds."""
    path = os.environ.get("PYTHONPATH", "")
    if HERE not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, path]))
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                failures.append(f"timed out after {timeout}s waiting for ranks")
                break
            if not ok:
                failures.append(f"--- rank {rank} raised:\n{value}")
                break
            import torch

            out[rank] = torch.load(io.BytesIO(value), weights_only=True)
    finally:
        for p in procs:
            p.join(timeout=10 if not failures else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    return [out[r] for r in range(world)]
