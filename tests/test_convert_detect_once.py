"""``ckpt convert`` finds out what SRC is once: each format's probe runs at most once per conversion and our
manifest is parsed once, then handed down to the reader (it used to be probed three times and parsed twice)."""

from __future__ import annotations

import importlib
from collections import Counter
from pathlib import Path

import pytest
from ckpt.converters import formats
from ckpt.converters.convert import ConvertOptions, convert, load_config

from ckpt.format.manifest import Manifest

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Path:
    """A CUDA-layout checkpoint of ours, converted from the fixture's NxD tag."""
    dst = tmp_path_factory.mktemp("once") / "ckpt"
    convert(str(FIX / "nxd_from_full_tp2_pp2"), str(dst),
            ConvertOptions(to="cuda", config=load_config(str(FIX)), step=3))  # fmt: skip
    return dst


def _count_probes(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Count (without replacing) every format's ``detect`` / ``is_adapter`` and every manifest parse."""
    calls: Counter = Counter()
    for fmt in formats.FORMATS:
        mod = importlib.import_module(fmt.module, formats.__package__)
        for verb in ("detect", "is_adapter"):
            real = getattr(mod, verb, None)
            if real is not None:
                def spy(*a, _real=real, _key=f"{fmt.name}.{verb}", **k):  # noqa: ANN002, ANN003, ANN202
                    calls[_key] += 1
                    return _real(*a, **k)

                monkeypatch.setattr(mod, verb, spy)
    real_parse = Manifest.from_json

    def parse(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls["manifest parsed"] += 1
        return real_parse(*a, **k)

    monkeypatch.setattr(Manifest, "from_json", staticmethod(parse))
    return calls


def test_our_checkpoint_is_probed_once_and_its_manifest_parsed_once(
    ours: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_probes(monkeypatch)
    r = convert(str(ours), str(tmp_path / "hf"), ConvertOptions(to="cuda", format="hf"))
    assert r.tensors > 0
    assert calls["manifest parsed"] == 1, calls
    assert calls["ckpt.is_adapter"] == 1 and calls["ckpt.detect"] == 1, calls
    assert max(calls.values()) == 1, calls


def test_an_nxd_tag_is_probed_once_per_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_probes(monkeypatch)
    convert(str(FIX / "nxd_from_full_tp2_pp2"), str(tmp_path / "c"),
            ConvertOptions(to="cuda", config=load_config(str(FIX)), step=3))  # fmt: skip
    assert calls["nxd.detect"] == 1 and calls["nxd.is_adapter"] == 1, calls
    assert max(calls.values()) == 1, calls
