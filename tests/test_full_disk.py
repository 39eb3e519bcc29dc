"""Issue 37 item 4: a destination that refuses a write, on a real small tmpfs.

ENOSPC (a full disk), EROFS (remounted read-only), EACCES (a folder this process may not write: a subprocess run by
root with the capabilities that bypass file modes dropped, ``setpriv``), and a missing bucket on a moto S3 server,
for every output format of ``convert`` and for ``CheckpointManager.save`` (sync and async, the writer process
included): one line naming the destination, what was being written and why, exit code 2, and nothing left that
looks complete.  EDQUOT cannot be made here (this kernel's tmpfs has no quota support): its line is checked on the
errno alone.  Mounting needs root; without it every test here is skipped with that reason.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt.storage.refusal import WriteRefusedError, refused
from tests.cli_helpers import FIX, ROOT, assert_one_error, ckpt_cli, tree

LORA = ROOT / "fixtures" / "nxd_lora"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``mount(size)``: a fresh tmpfs of ``size`` (``300k``) under ``tmp_path``, unmounted afterwards."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        d = tmp_path / f"disk{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True,
                           text=True)  # fmt: skip
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
        mounted.append(d)
        return d

    yield mount
    for d in reversed(mounted):
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF model folder of 584 KiB: each output format of it is larger than a 300 KiB disk."""
    src = tmp_path_factory.mktemp("src") / "hf"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIX / name, src / name)
    return src


@pytest.fixture(scope="module")
def lora_tag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An NxD LoRA tag made by ``ckpt convert`` from the PEFT fixture (the SRC of ``--format peft``)."""
    tag = tmp_path_factory.mktemp("lora") / "tag"
    r = _cli("convert", LORA / "adapter", tag, "--to", "neuron", "--format", "nxd", "--tp", "2", "--qkv-linear",
             "--config", LORA / "base" / "config.json", "--step", "3")  # fmt: skip
    assert r.exit_code == 0, r.output
    return tag


def _cli(*args: object) -> object:
    """The ``ckpt`` command in this process (the same command group, so the same lines and exit codes)."""
    from ckpt.cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def _one_error(r: object, *needles: str) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("ckpt: error: ")]  # type: ignore[attr-defined]
    assert r.exit_code == 2, (r.exit_code, r.output)  # type: ignore[attr-defined]
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # type: ignore[attr-defined]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr  # type: ignore[attr-defined]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


#: every output format, with the target layout and the flags it needs from the HF SRC
FORMATS = {
    "ckpt": ("cuda", ["--step", "5"]),
    "dcp": ("cuda", []),
    "hf": ("cuda", []),
    "hf-trainer": ("cuda", ["--step", "5"]),
    "nxd": ("neuron", ["--tp", "2", "--step", "5"]),
    "nxdt": ("neuron", ["--tp", "2", "--step", "5", "--consumed-samples", "10"]),
    "optimum-neuron": ("neuron", ["--tp", "2", "--step", "5"]),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_on_a_full_disk_says_where_and_what_in_one_line(
    fmt: str, hf_src: Path, tmpfs: Callable[[str], Path]
) -> None:
    """nxd, dcp and optimum-neuron ended in torch's ``RuntimeError ... unexpected pos`` traceback, the others in a
    line naming no path."""
    disk = tmpfs("300k")
    dst = disk / ("run--step=5-consumed_samples=10.0.ckpt" if fmt == "nxdt" else "out")
    to, flags = FORMATS[fmt]
    r = _cli("convert", hf_src, dst, "--to", to, "--format", fmt, *flags)
    line = _one_error(r, str(dst), f"--format {fmt} output", "no space left on device (", "nothing was committed")
    assert ".tmp-" not in line  # the file as the user knows it, not our staging folder
    assert tree(disk) == {} and os.listdir(disk) == []  # no DST, no staging folder, no temp file


def test_workers_on_a_full_disk(hf_src: Path, tmpfs: Callable[[str], Path]) -> None:
    """The real command, ``--format dcp --workers 2``: the failing worker's file named, exit 2, nothing left."""
    disk = tmpfs("300k")
    r = ckpt_cli("convert", hf_src, disk / "out", "--to", "cuda", "--format", "dcp", "--workers", "2")
    assert_one_error(r, f"{disk / 'out'}: cannot write the --format dcp output: no space left on device (__")
    assert os.listdir(disk) == []


@pytest.mark.parametrize("fmt", ["peft", "nxd", "ckpt"])
def test_lora_adapters_on_a_full_disk(fmt: str, lora_tag: Path, tmpfs: Callable[[str], Path]) -> None:
    """The adapter conversions (run whole, not by the engine; ``ckpt`` goes through a save): the same line."""
    disk = tmpfs("16k")
    dst = disk / "out"
    src, to, flags = {
        "peft": (lora_tag, "cuda", []),
        "nxd": (LORA / "adapter", "neuron", ["--tp", "2", "--qkv-linear"]),
        "ckpt": (LORA / "adapter", "cuda", ["--step", "3"]),
    }[fmt]
    r = _cli("convert", src, dst, "--to", to, "--format", fmt, "--config", LORA / "base" / "config.json", *flags)
    _one_error(r, str(dst), "no space left on device (")
    assert os.listdir(disk) == []


def test_a_read_only_disk(hf_src: Path, tmpfs: Callable[[str], Path]) -> None:
    """EROFS: refused before any work (the pre-check names the read-only file system), and nothing written."""
    disk = tmpfs("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    r = _cli("convert", hf_src, disk / "out", "--to", "neuron", "--format", "nxd", "--tp", "2")
    _one_error(r, f"DST {disk / 'out'}", "read-only file system")
    assert os.listdir(disk) == []


_NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]


def _no_dac_available() -> str | None:
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    r = subprocess.run([*_NO_DAC, "true"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"setpriv cannot drop capabilities here: {r.stderr.strip()}"


def test_a_folder_this_user_may_not_write(hf_src: Path, tmpfs: Callable[[str], Path]) -> None:
    """EACCES: root ignores file modes, so the real command runs without the capabilities that let it."""
    why = _no_dac_available()
    if why:
        pytest.skip(why)
    disk = tmpfs("1m")
    os.chmod(disk, 0o555)
    r = subprocess.run([*_NO_DAC, sys.executable, "-m", "ckpt", "convert", str(hf_src), str(disk / "out"), "--to",
                        "cuda", "--format", "hf"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PJRT_DEVICE": "CPU"})  # fmt: skip
    assert_one_error(r, f"DST {disk / 'out'}", "not writable")
    assert os.listdir(disk) == []


# ------------------------------------------------------------------------------------------------ save()

_SAVE = """
import sys, torch
from ckpt import CheckpointManager
from ckpt.errors import SaveRefusedError, StorageError
m = CheckpointManager(sys.argv[1], async_save=sys.argv[2] == "async")
try:
    m.save(1, model=torch.nn.Linear(256, 256))
    m.wait()
except SaveRefusedError as e:
    assert isinstance(e, StorageError)
    print(e)
finally:
    m.close()
"""


def _save(root: Path, mode: str, *prefix: str) -> str:
    r = subprocess.run([*prefix, sys.executable, "-c", _SAVE, str(root), mode], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PJRT_DEVICE": "CPU"})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout  # the save raised SaveRefusedError, one line
    return lines[0]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_on_a_full_disk(mode: str, tmpfs: Callable[[str], Path]) -> None:
    """``CheckpointManager.save`` (async: the writer process writes the data file): a one-line storage error naming
    the step folder and the file, and no step that looks committed."""
    disk = tmpfs("128k")  # the Linear's 257 KiB do not fit
    line = _save(disk / "run", mode)
    step = disk / "run" / "step_00000001"
    assert line.startswith(f"save of step 1 to {step} failed, not committed: rank 0: no space left on device (r0")
    assert not (step / "manifest.json").exists()
    assert [p for p in disk.rglob("*") if p.is_file()] == []  # no data file, no temp file
    from ckpt import CheckpointManager

    assert [c.status for c in CheckpointManager(str(disk / "run")).list()] == ["uncommitted"]


@pytest.mark.parametrize("how", ["read-only", "no permission"])
def test_save_where_it_may_not_write(how: str, tmpfs: Callable[[str], Path]) -> None:
    disk = tmpfs("1m")
    prefix: list[str] = []
    if how == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    else:
        why = _no_dac_available()
        if why:
            pytest.skip(why)
        os.chmod(disk, 0o555)
        prefix = _NO_DAC
    line = _save(disk / "run", "async", *prefix)
    want = "read-only file system" if how == "read-only" else "permission denied"
    assert line.endswith(f"rank 0: {want} ({disk / 'run'})"), line
    assert os.listdir(disk) == []


# ------------------------------------------------------------------------------------------------ object store


@pytest.mark.s3
@pytest.mark.parametrize("fmt", ["ckpt", "nxd"])
def test_an_object_store_without_the_bucket(fmt: str, s3: object, hf_src: Path) -> None:
    """``s3://nobucket/...``: the line names the destination and the missing bucket (it said only "The specified
    bucket does not exist")."""
    env = {"AWS_ENDPOINT_URL_S3": s3.endpoint or "", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}  # type: ignore[attr-defined]
    if s3.endpoint is None:  # type: ignore[attr-defined]
        pytest.skip("a real endpoint: its missing bucket may be another account's")
    to, flags = FORMATS[fmt]
    url = "s3://no-such-bucket-ckpt/out"
    r = ckpt_cli("convert", hf_src, url, "--to", to, "--format", fmt, *flags, env=env)
    r.stderr = "\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith("ckpt: warning: "))
    assert_one_error(r, f"{url}: cannot write the --format {fmt} output: no such bucket; nothing was committed")


def test_a_quota_refusal_reads_as_one_line() -> None:
    """EDQUOT (no quota-capable file system here): the line from the errno and the file, as for ENOSPC."""
    exc = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    exc.__context__ = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    wrapped = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/q/.out.tmp-1a2b/model/dp_rank_00.pt")
    wrapped.__cause__ = exc
    err = refused(wrapped, "/q/out", "the --format nxd output")
    assert isinstance(err, WriteRefusedError)
    assert str(err) == "/q/out: cannot write the --format nxd output: disk quota exceeded (model/dp_rank_00.pt); " \
        "nothing was committed"  # fmt: skip
    assert refused(OSError(errno.EDQUOT, "x", "/elsewhere/src.pt"), "/q/out", "it") is None  # not DST's refusal
