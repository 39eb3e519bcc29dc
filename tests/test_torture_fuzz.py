"""Bad and hostile input, fuzzed with hypothesis: manifests, pickles with malicious globals, CLI arguments.

* Manifests: mutations of a real manifest (keys dropped, values replaced by wrong types, absurd numbers, hostile
  file names), re-sealed so that they reach structural validation, are either accepted with every referenced file
  inside the checkpoint, or refused with one ``ManifestError`` line — never another exception type.  Random byte
  flips of a sealed manifest are all refused.
* Pickles (the NxD ``.pt`` and DCP ``.metadata`` way in): a global such as ``os.system`` is refused by
  ``ckpt.safe_unpickle`` and never called (the marker file it would create stays absent).
* CLI: random arguments and paths to ``ls/inspect/verify/verify-resume/report`` end with exit code 0/1/2, one error
  line, no traceback, and nothing written.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.errors import CkptError, ManifestError, UnsafePickleError
from ckpt.format.manifest import Manifest, seal
from ckpt.safe_unpickle import load_pickle, load_torch_file

pytestmark = pytest.mark.timeout(300)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("fuzz") / "step_00000001"
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 3)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 6)).sum().backward()
    opt.step()
    ckpt.save(str(path), step=1, model=m, optimizer=opt)
    return path, json.loads((path / "manifest.json").read_text())


HOSTILE_NAMES = [
    "..",
    "../x.safetensors",
    "/etc/passwd",
    "a/../../b",
    "./x",
    "a//b",
    "c:x",
    "x\\..\\y",
    "x\x00y",
    "",
    "~/x",
    "a/./b",
    "%2e%2e/x",
    "s3://bucket/x",
    "file:///etc/passwd",
]
ATOMS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 2**31, 2**53, 2**63, 2**64]),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.sampled_from(HOSTILE_NAMES),
)
VALUES = st.recursive(
    ATOMS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def paths_of(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += paths_of(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn, doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 4))):
        targets = [p for p in paths_of(doc) if p]
        path = draw(st.sampled_from(targets))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "rename"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "rename" and isinstance(parent, dict):
            parent[draw(st.sampled_from(HOSTILE_NAMES))] = parent.pop(path[-1])
        else:
            parent[path[-1]] = draw(VALUES)
    return doc


@given(data=st.data())
@FUZZ
def test_fuzzed_manifests_are_accepted_safely_or_refused_in_one_line(
    good: tuple[Path, dict[str, Any]], data: st.DataObject
) -> None:
    path, doc = good
    bad = data.draw(mutated(doc))
    try:
        # sealed after fuzzing: an unsealed edit would only ever test the checksum, never the deep validation
        m = Manifest.from_json(seal(bad, allow_nan=True), "manifest.json")
    except ManifestError as e:
        assert "\n" not in str(e) and str(e).startswith("manifest.json")
        return
    root = os.path.realpath(path)
    names = set(m.files) | {s.file for t in m.tensors.values() for s in t.shards}
    for name in names:  # anything accepted stays inside the checkpoint
        assert os.path.realpath(os.path.join(root, name)).startswith(root + os.sep), name


@given(data=st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_reading_through_a_fuzzed_manifest_raises_only_ckpt_errors(
    good: tuple[Path, dict[str, Any]], data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path, doc = good
    bad = data.draw(mutated(doc))
    ck = tmp_path_factory.mktemp("read") / "c"
    shutil.copytree(path, ck)
    (ck / "manifest.json").write_text(seal(bad, allow_nan=True))
    try:
        reader = ckpt.open_checkpoint(str(ck))
        for name in reader.names():
            if (
                reader.entry(name).nbytes <= 1 << 20
            ):  # a fuzzed 2**50-element shape is refused by size elsewhere
                reader.read(name)
    except CkptError as e:
        assert "\n" not in str(e)


@given(data=st.data())
@FUZZ
def test_byte_flips_of_a_sealed_manifest_are_all_refused(
    good: tuple[Path, dict[str, Any]], data: st.DataObject
) -> None:
    """1-3 random bytes XORed with random non-zero masks, anywhere (the checksum member included): JSON error,
    version error or checksum mismatch, always."""
    raw = bytearray((good[0] / "manifest.json").read_bytes())
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] ^= data.draw(st.integers(1, 255))
    if bytes(raw) == (good[0] / "manifest.json").read_bytes():
        return  # two flips of the same byte cancelled out
    with pytest.raises(ManifestError) as info:
        Manifest.from_json(bytes(raw), "manifest.json")
    assert "\n" not in str(info.value) and str(info.value).startswith("manifest.json")


# ------------------------------------------------------------------------------------------------ pickles


def _evil_callables(marker: Path) -> list[tuple[Any, tuple]]:
    import builtins
    import subprocess as sp

    cmd = f"touch {marker}"
    return [
        (os.system, (cmd,)),
        (sp.call, ([sys.executable, "-c", f"open({str(marker)!r}, 'w')"],)),
        (builtins.exec, (f"open({str(marker)!r}, 'w').close()",)),
        (builtins.eval, (f"open({str(marker)!r}, 'w')",)),
        (Path.touch, (marker,)),
    ]


class _Evil:
    def __init__(self, fn: Any, args: tuple) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


@given(which=st.integers(0, 4), depth=st.integers(0, 3), zip_format=st.booleans(), key=st.text(max_size=5))
@settings(max_examples=40, deadline=None)
def test_torch_files_with_malicious_globals_are_refused_not_run(
    tmp_path_factory: pytest.TempPathFactory, which: int, depth: int, zip_format: bool, key: str
) -> None:
    d = tmp_path_factory.mktemp("pkl")
    marker = d / "pwned"
    fn, args = _evil_callables(marker)[which]
    payload: Any = _Evil(fn, args)
    for _ in range(depth):  # hide it inside NxD-like containers next to real tensors
        payload = {"model": {key: payload, "w": torch.ones(2)}, "step": [payload]}
    f = d / "model.pt"
    torch.save(payload, f, _use_new_zipfile_serialization=zip_format)
    with pytest.raises(UnsafePickleError, match="refused to unpickle") as info:
        load_torch_file(f)
    assert "\n" not in str(info.value) and "model.pt" in str(info.value)
    assert not marker.exists()


@given(which=st.integers(0, 4), protocol=st.integers(2, pickle.HIGHEST_PROTOCOL))
@settings(max_examples=30, deadline=None)
def test_plain_pickles_with_malicious_globals_are_refused_not_run(
    tmp_path_factory: pytest.TempPathFactory, which: int, protocol: int
) -> None:
    # DCP's .metadata is a plain pickle read with an explicit allow-list (torch.Size here, as for DCP)
    marker = tmp_path_factory.mktemp("pkl") / "pwned"
    fn, args = _evil_callables(marker)[which]
    raw = pickle.dumps({"size": torch.Size([2, 3]), "x": _Evil(fn, args)}, protocol=protocol)
    with pytest.raises(UnsafePickleError, match="refused to unpickle global"):
        load_pickle(io.BytesIO(raw), {("torch", "Size"): torch.Size}, where=".metadata")
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ CLI

COMMANDS = ["ls", "inspect", "verify", "verify-resume", "report"]
FLAGS = ["--json", "--check-files", "--shards", "--plot", "--source", "--bogus", "-x", "--", "-", "--json=1"]


@pytest.fixture(scope="module")
def playground(tmp_path_factory: pytest.TempPathFactory, good: tuple[Path, dict[str, Any]]) -> Path:
    """Paths a user might point the CLI at: a good checkpoint, a garbage one, a file, an empty dir."""
    base = tmp_path_factory.mktemp("cli")
    shutil.copytree(good[0], base / "ok" / "step_00000001")
    garbage = base / "garbage" / "step_00000002"
    garbage.mkdir(parents=True)
    (garbage / "manifest.json").write_text('{"format": "ckpt", "format_version": 1, "step": []}')
    (base / "empty").mkdir()
    (base / "file.txt").write_text("hello")
    (base / "ledger.jsonl").write_text('{"not": "a ledger"}\n{{{\n')
    return base


def snapshot(base: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in base.rglob("*")}


def path_args(base: Path) -> st.SearchStrategy[str]:
    fixed = [
        "ok",
        "ok/step_00000001",
        "garbage",
        "garbage/step_00000002",
        "empty",
        "file.txt",
        "ledger.jsonl",
        "missing",
        "..",
        "/dev/null",
        "/proc/self/status",
        "file.txt/x",
        "memory://nothing",
        "file:///nonexistent",
        "",
    ]
    rel = st.sampled_from(fixed) | st.text(
        st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=12
    )
    return rel.map(lambda r: r if r.startswith(("/", "memory:", "file:")) or r == "" else str(base / r))


def run_cli(argv: list[str], cwd: Path) -> tuple[int, str]:
    """The real CLI entry point in-process (a subprocess per example would take minutes); returns (code, stderr)."""
    from ckpt.cli.main import main

    err, out = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                main(argv)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(old)
    return code, err.getvalue()


@given(data=st.data())
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_cli_survives_random_arguments(playground: Path, data: st.DataObject) -> None:
    cmd = data.draw(st.sampled_from(COMMANDS))
    args = data.draw(st.lists(path_args(playground) | st.sampled_from(FLAGS), min_size=0, max_size=3))
    before = snapshot(playground)
    code, err = run_cli([cmd, *args], playground / "empty")
    assert "Traceback" not in err
    assert code in (0, 1, 2), (cmd, args, code, err)
    if code != 0:
        errors = [ln for ln in err.splitlines() if ln.startswith(("Error:", "ckpt: error:"))]
        damaged = [ln for ln in err.splitlines() if "damaged" in ln or "problem" in ln]
        assert len(errors) == 1 or (code == 1 and damaged), (cmd, args, err)
        assert all(len(ln) < 2000 for ln in err.splitlines())
    assert snapshot(playground) == before, (cmd, args)


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "/dev/null"],
        ["verify", "/proc/self"],
        ["ls", "file.txt"],
        ["inspect", "garbage/step_00000002"],
        ["verify-resume", "ledger.jsonl"],
        ["report", "missing"],
        ["verify", "--nope"],
    ],
)
def test_cli_hostile_arguments_as_a_subprocess(playground: Path, argv: list[str]) -> None:
    before = snapshot(playground)
    r = subprocess.run(
        [sys.executable, "-m", "ckpt", *argv], capture_output=True, text=True, timeout=120, cwd=playground
    )
    assert r.returncode == 2, (argv, r.stderr)
    assert "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith(("Error:", "ckpt: error:"))]) == 1
    assert snapshot(playground) == before
