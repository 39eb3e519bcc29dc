"""accelerate ``save_state`` folders with a ``sampler.bin`` (a pickled ``SeedableRandomSampler``), with real
accelerate at its defaults in fresh processes (``USE_TORCH_XLA=0``; ``tests/_accelerate_train.py``
``sampler_run``): listed, inspected, verified, diffed, converted to ckpt and back, and accelerate's own
``load_state`` of the converted folder continues the original run's order (and losses) exactly.

accelerate 1.16 writes the file only for a loader of an ``IterableDatasetShard`` whose sampler is a
``SeedableRandomSampler`` (the run puts one there with ``set_sampler``), and its ``load_state`` reads it with
``weights_only=True``: the run allow-lists the sampler's three classes first, as a user must.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cli_helpers import tree
from tests.test_accelerate import TRAIN, assert_one_error, ckpt_cli


def _orders(out: Path) -> dict:
    return json.loads((out / "orders.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two runs that saved their state: seed 7 after 2 epochs, seed 8 after 3 (``<run>/state``)."""
    base = tmp_path_factory.mktemp("sampler")
    a, b = base / "a", base / "b"
    r = _runs({"kind": "sampler", "out": str(a), "epochs": 2, "seed": 7},
              {"kind": "sampler", "out": str(b), "epochs": 3, "seed": 8})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return a, b


def _runs(*runs: dict) -> subprocess.CompletedProcess:
    """``tests/_accelerate_train.py`` runs, one after the other in one fresh process (one start-up's imports)."""
    env = {**os.environ, "USE_TORCH_XLA": "0", "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}  # fmt: skip
    return subprocess.run([sys.executable, str(TRAIN), json.dumps(list(runs))], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def _pickle_of(path: Path) -> bytes:
    """The ``data.pkl`` record of a ``torch.save`` zip (its folder prefix differs between a path and a stream)."""
    with zipfile.ZipFile(io.BytesIO(path.read_bytes())) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        return z.read(name)


def test_sampler_folder_through_every_command_and_back_resumes_the_same_order(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    run, _ = runs
    src = run / "state"
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "sampler.bin"} <= set(os.listdir(src))
    before = tree(src)
    rows = json.loads(ckpt_cli("ls", run, "--json").stdout)
    assert [(r["format"], r["name"], r["status"]) for r in rows] == [("accelerate", "state", "ok")]
    shown = ckpt_cli("inspect", src)
    assert shown.exit_code == 0, shown.output
    assert (
        "sampler: SeedableRandomSampler seed 7, epoch 2, all samples per epoch, data source "
        "torch.utils.data.dataset.TensorDataset of 24, generator cpu seed 8" in shown.stdout
    )
    facts = json.loads(ckpt_cli("inspect", src, "--json").stdout)["sampler"]
    assert (facts["seed"], facts["epoch"], facts["num_samples"], facts["replacement"]) == (7, 2, None, False)
    assert ckpt_cli("verify", src).exit_code == 0

    ours, back = tmp_path / "ours", tmp_path / "back"
    r = ckpt_cli("convert", src, ours, "--to", "cuda", "--format", "ckpt", "--step", "12")
    assert r.exit_code == 0, r.output
    manifest = json.loads((ours / "manifest.json").read_text())
    assert manifest["progress"] == {"step": 12, "epoch": 2}
    assert manifest["extra"]["accelerate"]["sampler"]["initial_seed"] == 7
    shown = ckpt_cli("inspect", ours)
    assert shown.exit_code == 0 and "sampler: SeedableRandomSampler seed 7, epoch 2" in shown.stdout, shown.output
    r = ckpt_cli("convert", ours, back, "--to", "cuda", "--format", "accelerate")
    assert r.exit_code == 0 and "not written" not in r.output, r.output
    r = ckpt_cli("convert", ours, tmp_path / "l.ckpt", "--to", "cuda", "--format", "lightning")  # has no place
    assert r.exit_code == 0 and "accelerate sampler" in r.stderr, r.output
    assert tree(src) == before  # the source is never touched
    # pickled exactly as accelerate pickled it: the same globals, fields, tensors and generator state
    assert _pickle_of(back / "sampler.bin") == _pickle_of(src / "sampler.bin")
    d = ckpt_cli("diff", src, back, "--json")
    assert d.exit_code == 0 and json.loads(d.stdout)["state"] == [], d.output

    # accelerate's own load_state of the converted folder, in a fresh process whose sampler had seed 999: the
    # original sampler is back and deals the original run's next two epochs, which train to the same losses
    resumed = tmp_path / "resumed"
    r = _runs({"kind": "sampler", "out": str(resumed), "epochs": 0, "resume": str(back)})
    assert r.returncode == 0, r.stderr[-3000:]
    full, cont = _orders(run), _orders(resumed)
    assert cont["restored"] == [7, 2]
    assert [e[0] for e in cont["epochs"]] == [2, 3]
    assert cont["epochs"] == full["epochs"][2:]


class OwnDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> int:
        return i


class Evil:
    def __reduce__(self) -> tuple:
        return (os.system, ("true",))


@pytest.mark.parametrize(
    ("source", "needles"),
    [
        (OwnDataset(), (f"global {OwnDataset.__module__}.OwnDataset", "nothing was executed")),
        (Evil(), ("system", "nothing was executed")),
        ({"x": 1}, ("data source is a dict", "TensorDataset or a list")),
    ],
    ids=["own-class", "reduce-to-os-system", "dict"],
)
def test_a_data_source_ckpt_does_not_know_is_refused_by_name(
    runs: tuple[Path, Path], tmp_path: Path, source: object, needles: tuple[str, ...]
) -> None:
    from ckpt.converters.accelerate_sampler import dump_fields

    folder = tmp_path / "acc"
    shutil.copytree(runs[0] / "state", folder)
    fields = {"data_source": source, "replacement": False, "_num_samples": None, "generator": None,
              "initial_seed": 7, "epoch": 2}  # fmt: skip
    (folder / "sampler.bin").write_bytes(dump_fields(fields))
    before = tree(folder)
    for args in (
        ("inspect", folder),
        ("verify", folder),
        ("convert", folder, tmp_path / "out", "--to", "cuda", "--format", "ckpt"),
    ):
        assert_one_error(ckpt_cli(*args), "sampler.bin", *needles, code=2)
    assert not (tmp_path / "out").exists() and tree(folder) == before


def test_diff_shows_a_sampler_whose_seed_and_epoch_differ(runs: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = (r / "state" for r in runs)
    d = ckpt_cli("diff", a, b)
    assert d.exit_code == 1, d.output
    assert "sampler seed: 7 -> 8" in d.stdout and "sampler epoch: 2 -> 3" in d.stdout, d.stdout
    doc = json.loads(ckpt_cli("diff", a, b, "--json").stdout)
    assert {"sampler seed: 7 -> 8", "sampler epoch: 2 -> 3"} <= set(doc["state"]) and not doc["same"]
    # the same model and optimizer with only the sampler changed: the sampler alone makes them differ
    c = tmp_path / "c"
    shutil.copytree(a, c)
    shutil.copy(b / "sampler.bin", c / "sampler.bin")
    d = ckpt_cli("diff", a, c, "--json")
    doc = json.loads(d.stdout)
    assert d.exit_code == 1 and doc["changed"] == [] and "sampler epoch: 2 -> 3" in doc["state"], d.stdout


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**63 - 1),
    epoch=st.integers(0, 10**6),
    num_samples=st.none() | st.integers(1, 50),
    replacement=st.booleans(),
    generator=st.none() | st.integers(0, 2**32),
    source=st.one_of(
        st.tuples(st.integers(0, 6), st.integers(1, 3), st.sampled_from([torch.float32, torch.int64, torch.bfloat16])),
        st.lists(st.integers(-5, 5) | st.text(max_size=3), max_size=6),
    ),
)
def test_sampler_pickle_reads_and_writes_back_byte_for_byte(
    seed: int, epoch: int, num_samples: int | None, replacement: bool, generator: int | None, source: object
) -> None:
    """Whatever fields a sampler holds: read as data, encoded as the manifest keeps it, and written back, the pickle
    is the one accelerate's fields make (same globals, fields, tensors, generator state: byte for byte for a
    TensorDataset), and the facts survive."""
    from ckpt.converters.accelerate_sampler import dump_fields, encode, facts, read_sampler, sampler_bytes

    if isinstance(source, tuple):
        n, width, dtype = source
        g = torch.Generator().manual_seed(n)
        data: object = torch.utils.data.TensorDataset(
            *(torch.randint(0, 9, (n, width), generator=g).to(dtype) for _ in range(2))
        )
    else:
        data = source
    gen = None if generator is None else torch.Generator().manual_seed(generator)
    if gen is not None:
        torch.randperm(5, generator=gen)  # a state past its seed
    original = dump_fields({"data_source": data, "replacement": replacement, "_num_samples": num_samples,
                            "generator": gen, "initial_seed": seed, "epoch": epoch})  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "sampler.bin"
        path.write_bytes(original)
        record = read_sampler(path)
        written = sampler_bytes(json.loads(json.dumps(encode(record))))
        (Path(d) / "again.bin").write_bytes(written)
        if isinstance(data, torch.utils.data.TensorDataset):  # (a list's equal strings may be memoized differently)
            assert _pickle_of(Path(d) / "again.bin") == _pickle_of(path)
        again = read_sampler(Path(d) / "again.bin")
    if isinstance(data, list):
        assert again["data_source"]["items"] == data
    f = facts(encode(again))
    assert (f["seed"], f["epoch"], f["num_samples"], f["replacement"]) == (seed, epoch, num_samples, replacement)
    assert f == facts(encode(record))
    assert f["data_source"].endswith(f" of {len(data)}")  # type: ignore[arg-type]
