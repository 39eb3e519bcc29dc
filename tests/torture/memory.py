"""Peak-memory measurement of ``convert`` for every source x target format (tests/test_convert_memory.py and
bench/bench_memory.py).

* :func:`generate_cuda` writes a Llama-shaped fp32 CUDA-layout checkpoint (our format) with two Adam moments, one
  tensor at a time and cheaply (``torch.empty(...).uniform_``, no ``randn`` of the whole model);
* :func:`make_sources` converts it (unmeasured) into every source format: ckpt, HF, DCP, NxD plain (ZeRO-1 over
  DP 2) and NxD xser;
* :func:`measure` runs a list of conversions in ONE child process (imports paid once) and, for each, polls the
  child's ``/proc/<pid>/status`` every millisecond from this process: the peak ``RssAnon`` (anonymous memory: what
  the conversion holds, page cache and memory-mapped files excluded) and peak ``VmRSS``, both minus the child's own
  values right before the conversion starts (imports done, previous conversion's memory returned with
  ``malloc_trim``).  It also records the dry-run report's ``peak_memory_estimate`` of the same conversion.

Polling from another process sees what the kernel accounts, whatever the child does; a peak shorter than the poll
interval can be missed, so the bound is checked on models whose working set changes slowly (tensors of MiBs).
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20

#: small enough to generate in a second, big enough that no tensor is more than ~3% of the model
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 384,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 1024,
    "vocab_size": 4096,
    "tie_word_embeddings": False,
}
#: the NxD source's layout (ZeRO-1 over DP 2) and the NxD targets' (re-sharded over TP, PP and DP)
SOURCE_NXD = {"tp": 2, "pp": 2, "dp": 2}
TARGET_NXD = {"tp": 2, "pp": 4, "dp": 2}
SOURCES = ("ckpt", "hf", "dcp", "nxd", "nxd_xser")
TARGETS = ("ckpt", "hf", "dcp", "nxd", "nxd_xser")


def config(layers: int, **dims: Any) -> dict[str, Any]:
    return {**CONFIG, **dims, "num_hidden_layers": layers}


def generate_cuda(path: Path, cfg: dict[str, Any], *, optimizer: bool = True, seed: int = 0) -> int:
    """A CUDA-layout checkpoint of ``cfg`` (fp32; with ``optimizer``, AdamW ``exp_avg``/``exp_avg_sq`` and a
    ``step``), written one tensor at a time; returns the tensor bytes."""
    import torch

    from ckpt.format import treecodec
    from ckpt.layouts import ModelDims
    from ckpt.saving.writer import StreamingWriter

    g = torch.Generator().manual_seed(seed)
    shapes = ModelDims.from_hf_config(cfg).hf_shapes()
    w = StreamingWriter(str(path), flush_bytes=64 * MIB)
    total = 0
    for n, s in shapes.items():
        w.add(n, torch.empty(s).uniform_(-1, 1, generator=g))
        total += 4 * torch.Size(s).numel()
        if optimizer:
            for key in ("exp_avg", "exp_avg_sq"):
                t = torch.empty(s).uniform_(0, 1e-3, generator=g)
                w.add(f"optim/{n}/{key}", t, role="optimizer_state", param=n, key=key)
                total += 4 * t.numel()
    trees: dict[str, Any] = {"extra": {"config": cfg}}
    if optimizer:
        trees["optimizer"] = {
            "type": "torch.optim.adamw.AdamW",
            "param_groups": [{"lr": 0.001, "weight_decay": 0.0, "params": list(shapes)}],
            "state": {n: {"step": treecodec.encode(torch.tensor(3.0))} for n in shapes},
        }
    w.commit(step=3, backend="cuda", trees=trees)
    return total


def target_options(target: str, cfg: dict[str, Any], nxd: dict[str, Any] | None = None) -> Any:
    """The ConvertOptions of one target format (``nxd``: the NxD targets' layout, default :data:`TARGET_NXD`)."""
    from ckpt.converters.convert import ConvertOptions

    if target.startswith("nxd"):
        flags = nxd or TARGET_NXD
        return ConvertOptions.neuron(format="nxd", xser=target == "nxd_xser", config=cfg, **flags)
    return ConvertOptions(to="cuda", format=target, config=cfg)


def make_sources(
    root: Path, base: Path, cfg: dict[str, Any], which: tuple[str, ...] = SOURCES
) -> dict[str, Path]:
    """``base`` (a CUDA ckpt) in every source format under ``root`` (HF holds no optimizer)."""
    from ckpt.converters.convert import ConvertOptions, convert

    out: dict[str, Path] = {}
    for name in which:
        if name == "ckpt":
            out[name] = base
            continue
        dst = root / f"src_{name}" / ("step_3" if name.startswith("nxd") else "")
        if name.startswith("nxd"):
            opts = ConvertOptions.neuron(format="nxd", xser=name == "nxd_xser", config=cfg, **SOURCE_NXD)
        else:
            opts = ConvertOptions(to="cuda", format=name, config=cfg)
        convert(str(base), str(dst), opts)
        out[name] = dst
    return out


_CHILD = r"""
import ctypes, gc, json, re, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
jobs = json.loads(sys.argv[2])
import torch
torch.set_num_threads(1)
from ckpt.converters.convert import convert, describe, open_source, plan_conversion
from ckpt.converters.convert import ConvertOptions, RunOptions
from torture.memory import target_options
from ckpt.converters import ckpt, dcp, hf, nxd  # every format's module, imported before the baseline
import safetensors.torch, torch.distributed.checkpoint  # noqa
libc = ctypes.CDLL("libc.so.6")
if sys.argv[3] == "cli":  # what `ckpt convert` does first
    from ckpt.converters.engine.allocator import pin_malloc
    assert pin_malloc()

def quiet():
    gc.collect()
    libc.malloc_trim(0)

for job in jobs:
    if "diff" in job:  # ckpt diff A B instead of a conversion: no estimate; A and B must compare equal
        from ckpt.converters.diff import diff
        quiet()
        print("ready", json.dumps({"estimate": 0}), flush=True)
        sys.stdin.readline()
        t0 = time.perf_counter()
        result = diff(*job["diff"], config=job["config"], allow_unmarked=True)
        wall = time.perf_counter() - t0
        assert result.same and result.tensors, result.to_json()["changed"]
        print("done", json.dumps({"wall": wall}), flush=True)
        quiet()
        continue
    opts = target_options(job["target"], job["config"], job.get("nxd"))
    run = RunOptions(allow_unmarked=True, **({"flush_bytes": job["flush_bytes"]} if "flush_bytes" in job else {}))
    src = open_source(job["src"], opts, run)
    try:
        est = describe(plan_conversion(src, opts), opts, run)["peak_memory_estimate"]
    finally:
        src.close()
    del src
    quiet()
    print("ready", json.dumps({"estimate": est}), flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    convert(job["src"], job["dst"], opts, run)
    wall = time.perf_counter() - t0
    print("done", json.dumps({"wall": wall}), flush=True)
    quiet()
"""

_STATUS = re.compile(rb"^(RssAnon|VmRSS):\s+(\d+) kB", re.M)


def _status(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status", "rb") as f:
        text = f.read()
    return {k.decode(): int(v) * 1024 for k, v in _STATUS.findall(text)}


@dataclass(frozen=True)
class Peak:
    """One measured conversion: peaks above the child's own state right before it started, in bytes."""

    src: str
    target: str
    anon: int  # peak RssAnon growth
    rss: int  # peak VmRSS growth (includes mapped file pages)
    base_anon: int  # RssAnon before (the interpreter, torch, imports)
    estimate: int  # the dry-run's peak_memory_estimate
    wall: float


def measure(
    jobs: list[dict[str, Any]],
    *,
    poll_s: float = 0.001,
    timeout: float = 600,
    exact_malloc: bool = True,
    cli_malloc: bool = False,
) -> list[Peak]:
    """Run ``jobs`` (``{"src", "dst", "target", "config", "src_name"}``, optional ``"flush_bytes"`` for our writer and ``"nxd"``: the NxD targets' flags;
    or ``{"diff": [A, B], "src": A, "config", "src_name", "target"}``: ``ckpt diff A B``, which must find them equal)
    one after another in one child process and return each one's peak memory (see the module docstring).

    ``exact_malloc`` pins glibc's mmap and trim thresholds in the child (tests: measure what the code holds); off,
    the figures include what the allocator keeps (the bench reports both).  ``cli_malloc``: the child pins glibc's
    thresholds itself, as ``ckpt convert`` does (``converters/engine/allocator.py``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PJRT_DEVICE="CPU", PYTHONWARNINGS="ignore")
    if exact_malloc:
        # glibc otherwise raises its mmap threshold as big blocks are freed and keeps up to ~64 MiB of freed heap
        # per arena: RssAnon would measure the allocator's retention, not what the conversion holds
        env.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072", MALLOC_ARENA_MAX="2")
    payload = [{k: (str(v) if isinstance(v, Path) else v) for k, v in j.items()} for j in jobs]
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(ROOT / "tests"), json.dumps(payload), "cli" if cli_malloc else "-"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout

    def next_line(poll: dict[str, int] | None = None) -> str:
        while True:
            try:
                line = lines.get(timeout=poll_s if poll is not None else 1.0)
            except queue.Empty:
                line = ""
            if line is None:
                err = proc.stderr.read() if proc.stderr else ""
                raise RuntimeError(f"memory child died (rc {proc.wait()}): {err[-3000:]}")
            if line.startswith(("ready", "done")):
                return line
            if poll is not None:
                try:
                    for k, v in _status(proc.pid).items():
                        poll[k] = max(poll.get(k, 0), v)
                except (FileNotFoundError, ProcessLookupError):
                    pass
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError("memory child ran past its timeout")

    out: list[Peak] = []
    try:
        for job in jobs:
            ready = next_line()
            est = json.loads(ready.split(" ", 1)[1])["estimate"]
            before = _status(proc.pid)
            peak = dict(before)
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            done = next_line(peak)
            wall = json.loads(done.split(" ", 1)[1])["wall"]
            out.append(
                Peak(
                    str(job.get("src_name", job["src"])),
                    job["target"],
                    peak["RssAnon"] - before["RssAnon"],
                    peak["VmRSS"] - before["VmRSS"],
                    before["RssAnon"],
                    int(est),
                    wall,
                )  # fmt: skip
            )
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out
