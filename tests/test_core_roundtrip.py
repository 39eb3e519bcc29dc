"""Round trips: tensors through save/restore (dtypes, shapes, codecs, chunking), trees through treecodec,
manifests through JSON, and the manifest validator's refusals."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt
from ckpt import SaveOptions
from ckpt.errors import ManifestError
from ckpt.format import treecodec
from ckpt.format.manifest import MANIFEST_NAME, Box, Manifest, seal

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infinities, subnormals included) for floats; 0/1 for bool."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
    assert bits(a) == bits(b)


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
tensor_specs = st.tuples(st.sampled_from(DTYPES), shapes, st.integers(0, 2**31), st.booleans())


@SETTINGS
@given(
    specs=st.lists(tensor_specs, min_size=1, max_size=5),
    codec=st.sampled_from(["raw", "zstd"]),
    chunk_bytes=st.sampled_from([1, 7, 64, 1 << 20]),
)
def test_tensors_round_trip_bit_for_bit(
    specs: list[tuple[torch.dtype, tuple[int, ...], int, bool]], codec: str, chunk_bytes: int
) -> None:
    state: dict[str, torch.Tensor] = {}
    for i, (dtype, shape, seed, transpose) in enumerate(specs):
        t = random_tensor(dtype, shape, seed)
        if transpose and t.dim() >= 2:
            t = t.transpose(0, 1)  # not contiguous
        state[f"t{i}"] = t
    with tempfile.TemporaryDirectory() as d:
        saver = ckpt.Checkpointer(chunk_bytes=chunk_bytes, codec=codec)
        saver.save(f"{d}/c", step=1, model=state).result()
        reader = ckpt.open_checkpoint(f"{d}/c")
        for name, t in state.items():
            entry = reader.entry(name)
            assert entry.shape == tuple(t.shape)
            assert all(s.codec == codec for s in entry.shards)
            row_bytes = math.prod(t.shape[1:]) * t.element_size() if t.dim() else 0
            if t.dim() and t.shape[0] > 1 and row_bytes and row_bytes * t.shape[0] > chunk_bytes:
                assert len(entry.shards) > 1, "expected chunking"
            assert_same(reader.read(name), t)
        # restore in place into differently-initialised tensors
        live = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in state.items()}
        ckpt.restore(f"{d}/c", model=live, rng=False)
        for name, t in state.items():
            assert_same(live[name], t)


@SETTINGS
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    data=st.data(),
    codec=st.sampled_from(["raw", "zstd"]),
)
def test_any_box_reads_back(dtype: torch.dtype, shape: tuple[int, ...], data: Any, codec: str) -> None:
    t = random_tensor(dtype, shape, 1)
    offs, lens = [], []
    for n in shape:
        o = data.draw(st.integers(0, n))
        offs.append(o)
        lens.append(data.draw(st.integers(0, n - o)))
    box = Box(tuple(offs), tuple(lens))
    with tempfile.TemporaryDirectory() as d:
        ckpt.Checkpointer(chunk_bytes=5, codec=codec).save(f"{d}/c", step=0, model={"w": t}).result()
        out = torch.empty(box.lengths, dtype=dtype)
        ckpt.open_checkpoint(f"{d}/c").read_box_into("w", box, out)
    assert_same(out, t[box.relative_to(Box.full(shape))])


# ---------------------------------------------------------------------------------------------- treecodec


def _floats() -> st.SearchStrategy[float]:
    return st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
        [float("nan"), float("inf"), float("-inf"), -0.0]
    )


def _arrays() -> st.SearchStrategy[np.ndarray]:
    return st.tuples(
        st.sampled_from(["<f4", "<f8", "<i8", "|u1", "|b1", "<i2"]),
        st.lists(st.integers(0, 3), max_size=2).map(tuple),
        st.integers(0, 2**31),
    ).map(
        lambda a: (
            np.random.default_rng(a[2])
            .integers(0, 256, size=math.prod(a[1]) * np.dtype(a[0]).itemsize, dtype=np.uint8)
            .view(a[0] if a[0] != "|b1" else "|u1")
            .astype(a[0] if a[0] != "|b1" else "|b1")
            .reshape(a[1])
        )
    )


def _tensors() -> st.SearchStrategy[torch.Tensor]:
    return st.tuples(st.sampled_from(DTYPES), shapes, st.integers(0, 2**31)).map(lambda a: random_tensor(*a))


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | _floats()
    | st.text(max_size=8)
    | st.binary(max_size=12)
    | _arrays()
    | _tensors()
)
keys = st.text(max_size=6) | st.integers(-5, 5) | st.tuples(st.integers(0, 3), st.text(max_size=3))
trees = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(keys, inner, max_size=4)
    ),
    max_leaves=20,
)


def same_tree(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return math.isnan(a) and math.isnan(b) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_tree(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=200, deadline=None)
@given(tree=trees)
def test_treecodec_round_trip_through_strict_json(tree: Any) -> None:
    text = json.dumps(treecodec.encode(tree), allow_nan=False)
    back = treecodec.decode(json.loads(text))
    assert same_tree(back, tree), (tree, back)


def test_treecodec_specific_values() -> None:
    tree = {
        "tuple": (1, (2, "x")),
        1: "int key",
        (0, "a"): [float("nan"), float("inf"), -float("inf")],
        "$t": "a user key that looks like a tag",
        "bytes": b"\x00\xff",
        "np": np.arange(6, dtype=np.int32).reshape(2, 3),
        "t": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "dtype": torch.float16,
        "npscalar": np.float32(2.5),
        "np0d": np.array(3.5, dtype=np.float64),
        "row": torch.arange(2.0).reshape(2, 1).t()[0:1, 0:1],  # contiguous, but stride (1, 2)
    }
    back = treecodec.decode(json.loads(json.dumps(treecodec.encode(tree), allow_nan=False)))
    assert back["tuple"] == (1, (2, "x")) and back[1] == "int key" and back["$t"] == tree["$t"]
    assert all(math.isnan(v) or math.isinf(v) for v in back[(0, "a")])
    assert back["bytes"] == b"\x00\xff" and back["dtype"] is torch.float16 and back["npscalar"] == 2.5
    assert back["np"].dtype == np.int32 and (back["np"] == tree["np"]).all()
    assert torch.equal(back["t"], tree["t"]) and back["t"].dtype == torch.bfloat16
    assert back["np0d"].shape == () and back["np0d"] == 3.5
    assert back["row"].shape == (1, 1) and torch.equal(back["row"], tree["row"])


def test_treecodec_refuses_arbitrary_objects() -> None:
    class Thing:
        pass

    with pytest.raises(ManifestError, match=r"Thing at sched\.inner"):
        treecodec.encode({"inner": Thing()}, "sched")


# ---------------------------------------------------------------------------------------------- manifests


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    # format v1 pinned: the tests below are about v1's one-document JSON (its seal, its shards' validation);
    # v2's top manifest and sealed indexes are tested in tests/test_manifest_v2.py and tests/test_golden_v2.py
    saver = ckpt.Checkpointer(async_save=False, format_version=1)
    saver.save(
        str(tmp_path / "c"),
        step=7,
        model=model,
        optimizer=opt,
        scheduler=sched,
        options=SaveOptions(metadata={"a": (1, 2)}),
    ).result()
    return tmp_path / "c"


def test_manifest_json_round_trip(saved: Path) -> None:
    text = (saved / MANIFEST_NAME).read_text()
    m = Manifest.from_json(text)
    assert m.step == 7 and m.files and m.tensors
    again = Manifest.from_json(m.to_json())
    assert again == m
    assert m.to_json() == again.to_json()


def test_manifest_is_sealed_by_a_checksum_of_its_own_bytes(saved: Path) -> None:
    """The file starts with its checksum; the value is xxh3-64 of the file without that member (docs/format.md)."""
    import xxhash

    raw = (saved / MANIFEST_NAME).read_bytes()
    assert raw.startswith(b'{"checksum":"xxh3_64:') and raw[37:39] == b'",'
    assert raw[13:37].decode() == "xxh3_64:" + xxhash.xxh3_64_hexdigest(b"{" + raw[39:])
    assert seal(json.loads(raw)) == raw.decode()  # re-sealing an unchanged document is the identity


def test_an_edited_manifest_that_is_not_resealed_is_refused_as_damaged(saved: Path) -> None:
    doc = _doc(saved)
    doc["optimizer"]["param_groups"][0]["lr"] = 0.5  # restorable state nothing else could check
    edited = (saved / MANIFEST_NAME).read_text().replace('"lr":0.001', '"lr":0.5')
    assert edited != (saved / MANIFEST_NAME).read_text()
    with pytest.raises(
        ManifestError, match=r"^manifest\.json is damaged: checksum mismatch \(stored xxh3_64:"
    ):
        Manifest.from_json(edited, "manifest.json")
    with pytest.raises(ManifestError, match="is damaged: its checksum is missing or is not the file's first"):
        Manifest.from_json(json.dumps(doc, indent=1), "manifest.json")
    assert Manifest.from_json(seal(doc)).optimizer["param_groups"][0]["lr"] == 0.5  # re-sealed: accepted


def test_a_manifest_without_checksum_is_refused_as_damaged(saved: Path) -> None:
    """The checksum is required: a manifest that lacks it was damaged or hand-edited without ``seal``."""
    doc = _doc(saved)
    del doc["checksum"]
    with pytest.raises(ManifestError, match="is damaged: its checksum is missing"):
        Manifest.from_json(json.dumps(doc, separators=(",", ":")), "manifest.json")


def test_a_damaged_checksum_member_is_refused(saved: Path) -> None:
    raw = (saved / MANIFEST_NAME).read_text()
    for broken in (
        raw.replace('"checksum"', '"checksuo"', 1),
        raw.replace('"checksum":"xxh3_64:', '"checksuo":"xxh3_65:', 1),  # key and value both damaged
    ):
        with pytest.raises(ManifestError, match="is damaged: its checksum is missing"):
            Manifest.from_json(broken, "manifest.json")


def _doc(saved: Path) -> dict[str, Any]:
    return json.loads((saved / MANIFEST_NAME).read_text())


def _first_shard(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["tensors"]["weight"]["shards"][0]


def test_newer_format_version_is_refused_clearly(saved: Path) -> None:
    doc = _doc(saved)
    doc["format_version"] = ckpt.FORMAT_VERSION + 1
    newer = ckpt.FORMAT_VERSION + 1
    with pytest.raises(
        ManifestError, match=rf"format_version {newer} is newer.*\({newer - 1}\); upgrade ckpt"
    ):
        Manifest.from_json(json.dumps(doc))


@pytest.mark.parametrize(
    "bad", ["../x.safetensors", "/abs.safetensors", "a/../../b", "./x", "a//b", "c:x", ".."]
)
def test_unsafe_file_paths_are_refused(saved: Path, bad: str) -> None:
    doc = _doc(saved)
    name = _first_shard(doc)["file"]
    doc["files"][bad] = doc["files"].pop(name)
    for t in doc["tensors"].values():
        for s in t["shards"]:
            s["file"] = bad if s["file"] == name else s["file"]
    with pytest.raises(ManifestError, match="unsafe file name"):
        Manifest.from_json(seal(doc))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("offsets", [2, 0], "outside shape"),
        ("lengths", [3, 5], "outside shape"),
        ("offsets", [0], "box rank"),
        ("offset", 10**9, "lie outside"),
        ("offset", -1, "non-negative"),
        ("file", "other.safetensors", "not listed"),
        ("codec", "lz4", "unknown codec"),
        ("checksum", "md5:abc", "bad checksum"),
        ("nbytes", 3, "does not match its box"),
    ],
)
def test_inconsistent_shards_are_refused(saved: Path, field: str, value: Any, message: str) -> None:
    doc = _doc(saved)
    _first_shard(doc)[field] = value
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(seal(doc))


def test_garbage_manifests_are_refused(saved: Path) -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json(b"{trunc")
    with pytest.raises(ManifestError, match="not a ckpt manifest"):
        Manifest.from_json(json.dumps({"format": "other"}))
    doc = _doc(saved)
    doc["tensors"]["weight"]["dtype"] = "F128"
    with pytest.raises(ManifestError, match="unknown dtype"):
        Manifest.from_json(seal(doc))
    doc = _doc(saved)
    doc["step"] = True
    with pytest.raises(ManifestError, match="step"):
        Manifest.from_json(seal(doc))


def test_restore_of_a_newer_checkpoint_names_the_problem(saved: Path) -> None:
    doc = _doc(saved)
    doc["format_version"] = 99
    (saved / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=f"{MANIFEST_NAME}: format_version 99 is newer"):
        ckpt.restore(str(saved), model=torch.nn.Linear(4, 3))
