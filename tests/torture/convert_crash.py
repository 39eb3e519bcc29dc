"""Crash consistency of ``ckpt convert``: SIGKILL a real conversion at seeded random moments, then inspect DST.

One *trial* = start ``python -m ckpt convert SRC DST ...`` in its own process group, kill the whole group (the
coordinator and any ``--workers`` processes, as a node failure would) with SIGKILL, then check:

* DST holds nothing that looks valid, or else exactly the reference output (a kill that landed after the commit):
  our format: no ``manifest.json`` (or a manifest whose checkpoint fully verifies and equals the reference);
  HF / DCP: no DST folder (they are built in a hidden ``.<name>.tmp-<id>`` folder and renamed), or a byte-identical
  one; NxD: no ``done`` marker (or a ``done`` tag byte-identical to the reference);
* SRC is byte-identical to before (every file's SHA-256, and no file added or removed).

The kill moment: in a seeded quarter of the trials a uniform delay after the process starts (often still importing);
otherwise the harness waits until output appears next to DST (a data file, the temp folder) and then waits a uniform
fraction of the time the unkilled reference run spent writing, so most kills land inside the write or the commit.
What was seen at the kill (no output yet / output being written / process already finished) is recorded.
Anything that looks valid but is not the reference counts as ``corrupt`` (must be 0).
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "fixtures" / "nxd" / "llama_gqa_h64"
TAG = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
CONFIG = FIX / "config.json"

# name -> ckpt convert arguments after SRC DST.  Small HF shards so that there are several files to be cut.
CASES: dict[str, list[str]] = {
    "ckpt": ["--to", "cuda", "--format", "ckpt"],
    "ckpt-workers2": ["--to", "cuda", "--format", "ckpt", "--workers", "2"],
    "hf": ["--to", "cuda", "--format", "hf", "--max-shard-size", "100000"],
    "dcp": ["--to", "cuda", "--format", "dcp"],
    "nxd": ["--to", "neuron", "--format", "nxd", "--tp", "2", "--pp", "2", "--dp", "2", "--qkv-linear"],
}


def fmt_of(case: str) -> str:
    return case.split("-")[0]


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under ``root`` (directories implied)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def make_source(path: Path) -> Path:
    """Our CUDA-layout checkpoint of the NxD training fixture (model, Adam moments, scheduler): the SRC."""
    from ckpt.converters.convert import ConvertOptions, convert, load_config

    convert(str(TAG), str(path), ConvertOptions(to="cuda", from_="neuron", config=load_config(str(CONFIG))))
    return path


def command(case: str, src: Path, dst: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ckpt",
        "convert",
        str(src),
        str(dst),
        "--config",
        str(CONFIG),
        *CASES[case],
    ]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


def _committed(case: str, dst: Path) -> bool:
    """The format's commit point has been passed (what makes DST look valid)."""
    fmt = fmt_of(case)
    if fmt == "ckpt":
        return (dst / "manifest.json").exists()
    return (dst / "done").exists() if fmt == "nxd" else dst.exists()


def _output_seen(dst: Path) -> bool:
    """Anything the conversion has written so far: DST itself or a hidden temp folder next to it."""
    if dst.exists():
        return True
    return any(p.name.startswith(f".{dst.name}.") for p in dst.parent.iterdir())


@dataclass
class Reference:
    """The unkilled run of one case: its output's digest and how long it spent before/while writing."""

    digest: dict[str, str]
    tensors: dict[str, str] = field(default_factory=dict)  # ckpt format: tensor name -> SHA-256 of its bytes
    dcp: str = ""  # DCP: digest of the loaded checkpoint (its .metadata differs from run to run)
    until_output_s: float = 0.0
    writing_s: float = 0.0  # from the first output to the commit point


def _tensor_digests(path: Path) -> dict[str, str]:
    """Tensor name -> SHA-256 of its bytes (file names carry a per-attempt id, so files cannot be compared)."""
    import ckpt

    reader = ckpt.open_checkpoint(str(path))
    return {
        n: hashlib.sha256(reader.read(n).contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
        for n in reader.names()
    }


def reference(case: str, src: Path, work: Path) -> Reference:
    """Run the conversion to completion, timing when output first appears; the output is the reference."""
    dst = work / f"ref-{case}"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        command(case, src, dst), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    first = None
    committed = None
    while proc.poll() is None:
        if first is None and _output_seen(dst):
            first = time.monotonic()
        if committed is None and _committed(case, dst):
            committed = time.monotonic()
        time.sleep(0.002)
    end = committed or time.monotonic()  # the window worth killing in ends at the commit, not at exit
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"reference conversion {case} failed ({proc.returncode}): {err[-2000:]}")
    first = first if first is not None else end
    ref = Reference(tree_digest(dst), until_output_s=first - t0, writing_s=end - first)
    if fmt_of(case) == "ckpt":
        ref.tensors = _tensor_digests(dst)
    if fmt_of(case) == "dcp":
        ref.dcp = dcp_state(dst)
    return ref


@dataclass
class ConvertCrashReport:
    """Figures of a series of kills; ``corrupt`` and ``src_changed`` must be 0."""

    trials: int = 0
    by_case: dict[str, dict[str, int]] = field(default_factory=dict)
    killed_before_output: int = 0
    killed_while_writing: int = 0
    finished_before_kill: int = 0
    nothing_valid: int = 0
    complete_and_equal: int = 0
    unmarked_nxd_tags: int = 0
    leftover_temp_folders: int = 0
    leftover_ckpt_data_files: int = 0
    corrupt: int = 0
    src_changed: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d["problems"] = self.problems[:20]
        return d


def check_dst(case: str, dst: Path, ref: Reference, report: ConvertCrashReport) -> str:
    """Classify DST after a kill: ``nothing`` valid-looking, ``complete`` (equal to the reference), or ``corrupt``."""
    fmt = fmt_of(case)
    temps = [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.tmp")]
    report.leftover_temp_folders += len(temps)
    if fmt == "ckpt":
        if not (dst / "manifest.json").exists():
            report.leftover_ckpt_data_files += len(list(dst.glob("*.safetensors"))) if dst.exists() else 0
            return "nothing"
        import ckpt
        from ckpt.format.integrity import verify_checkpoint

        try:
            problems = verify_checkpoint(ckpt.open_checkpoint(str(dst)))
            same = not problems and _tensor_digests(dst) == ref.tensors
        except Exception as e:  # noqa: BLE001 - anything at all is a finding, reported with its text
            problems, same = [f"{type(e).__name__}: {e}"], False
        if not same:
            report.problems.append(f"{case}: a manifest exists but the checkpoint is wrong: {problems[:1]}")
        return "complete" if same else "corrupt"
    if not dst.exists():
        return "nothing"
    if fmt == "nxd" and not (dst / "done").exists():
        report.unmarked_nxd_tags += 1  # renamed into place, killed before `done`: NxD does not load it
        return "nothing"
    got = tree_digest(dst)
    if fmt == "dcp":
        # DCP's .metadata pickle carries a fresh save id per run: compare the data files byte for byte and the
        # whole checkpoint as torch.distributed.checkpoint itself loads it
        got.pop(".metadata", None)
        want = {k: v for k, v in ref.digest.items() if k != ".metadata"}
        if got == want and dcp_state(dst) != ref.dcp:
            got = {}
        return "complete" if got == want else _corrupt(case, got, want, report)
    if got != ref.digest:
        return _corrupt(case, got, ref.digest, report)
    return "complete"


def _corrupt(case: str, got: dict[str, str], want: dict[str, str], report: ConvertCrashReport) -> str:
    differ = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
    report.problems.append(f"{case}: DST looks valid but differs from the reference: {differ[:4]}")
    return "corrupt"


def dcp_state(root: Path) -> str:
    """SHA-256 of everything in a DCP checkpoint as loaded by ``torch.distributed.checkpoint`` (tensor bytes,
    keys, non-tensor values), independent of its per-save metadata ids."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    h = hashlib.sha256()

    def walk(x: Any, where: str) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"{where}:{x.dtype}:{list(x.shape)}".encode())
            h.update(x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{where}.{k}")
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                walk(v, f"{where}[{i}]")
        else:
            h.update(f"{where}={x!r}".encode())

    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(str(root), str(Path(d) / "all.pt"))
        walk(torch.load(Path(d) / "all.pt", weights_only=False), "")
    return h.hexdigest()


def run_trials(
    src: Path,
    work: Path,
    trials_per_case: int,
    *,
    seed: int = 0,
    cases: list[str] | None = None,
    progress: bool = False,
) -> ConvertCrashReport:
    """``trials_per_case`` kills for each case (all of :data:`CASES` by default) on local disk."""
    rng = random.Random(seed)
    report = ConvertCrashReport()
    started = time.monotonic()
    before = tree_digest(src)
    for case in cases or list(CASES):
        ref = reference(case, src, work)
        counts = report.by_case.setdefault(case, {"trials": 0, "nothing": 0, "complete": 0, "corrupt": 0})
        for trial in range(trials_per_case):
            dst = work / f"dst-{case}-{trial}" / "out"
            dst.parent.mkdir(parents=True)
            proc = subprocess.Popen(
                command(case, src, dst),
                env=_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: the kill takes the workers too
            )
            if rng.random() < 0.25:
                deadline = time.monotonic() + rng.uniform(0.0, ref.until_output_s)
                while time.monotonic() < deadline and proc.poll() is None:
                    time.sleep(0.002)
            else:
                while proc.poll() is None and not _output_seen(dst):
                    time.sleep(0.002)
                deadline = time.monotonic() + rng.uniform(0.0, 1.2 * ref.writing_s)
                while time.monotonic() < deadline and proc.poll() is None:
                    time.sleep(0.002)
            seen = _output_seen(dst)
            finished = proc.poll() is not None
            if not finished:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if finished:
                report.finished_before_kill += 1
            elif seen:
                report.killed_while_writing += 1
            else:
                report.killed_before_output += 1
            outcome = check_dst(case, dst, ref, report)
            report.trials += 1
            counts["trials"] += 1
            counts[outcome] += 1
            report.corrupt += outcome == "corrupt"
            report.nothing_valid += outcome == "nothing"
            report.complete_and_equal += outcome == "complete"
            if tree_digest(src) != before:
                report.src_changed += 1
                report.problems.append(f"{case} trial {trial}: SRC changed")
            shutil.rmtree(dst.parent)
            if progress:
                state = "finished" if finished else ("writing" if seen else "before output")
                print(f"{case} {trial + 1}/{trials_per_case}: killed {state}: {outcome}", flush=True)
    report.seconds = round(time.monotonic() - started, 1)
    return report
