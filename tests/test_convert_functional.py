"""Head pairing through the converter's own output: a reference TP forward computed only from the per-rank shards
cut out of our Neuron-layout manifest (box ``r`` of the partition dim = TP rank ``r``) equals the full model's
logits (trn1 and trn2, KV replication, fused QKV, Qwen2 biases).  And a crash mid-conversion leaves nothing that
looks valid."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt.converters.convert import ConvertOptions, RunOptions, convert
from ckpt.converters.engine import execute

import ckpt
from ckpt import open_checkpoint
from ckpt.layouts import LayoutSpec
from ckpt.layouts.partition import nxd_partition
from ckpt.layouts.pipeline import pp_ranks_of
from tests.test_layouts_functional import ATOL, _model, tp_forward

CASES = [
    ("llama", 8, 2, dict(tp=4, qkv_linear=True, kv_size_multiplier=2, hw="trn2")),
    ("llama", 8, 2, dict(tp=8, qkv_linear=True, kv_size_multiplier=4, hw="trn1", pp=2)),
    ("qwen2", 8, 2, dict(tp=4, qkv_linear=True, fuse_qkv=True, kv_size_multiplier=2, hw="trn1")),
    ("llama", 4, 4, dict(tp=2, fuse_qkv=True)),
]


def shards_from_manifest(path: Path, spec: LayoutSpec) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    r = open_checkpoint(str(path))
    out: dict[tuple[int, int], dict[str, torch.Tensor]] = {rank: {} for rank in spec.ranks}
    for name in r.names("parameter") + r.names("buffer"):
        t = r.read(name)
        dim = (nxd_partition(name) or (None,))[0]
        for pp in pp_ranks_of(name, spec):
            for tp in range(spec.tp):
                out[(tp, pp)][name] = t if dim is None else t.chunk(spec.tp, dim)[tp]
    return out


@pytest.mark.parametrize("kind,heads,kv,flags", CASES)
def test_tp_forward_from_converted_manifest(
    kind: str, heads: int, kv: int, flags: dict, tmp_path: Path
) -> None:
    model = _model(kind, heads, kv)
    cfg = model.config.to_dict()
    ckpt.save(str(tmp_path / "cuda"), step=1, model=model)
    convert(str(tmp_path / "cuda"), str(tmp_path / "neuron"), ConvertOptions.neuron(config=cfg, **flags))
    spec = LayoutSpec.from_hf_config(cfg, **flags)
    shards = shards_from_manifest(tmp_path / "neuron", spec)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(tp_forward(shards, spec, ids, model), model(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("fmt", ["ckpt", "hf", "dcp"])
def test_crash_mid_conversion_leaves_nothing_valid(fmt: str, tmp_path: Path, monkeypatch) -> None:
    model = _model("llama", 4, 2)
    ckpt.save(str(tmp_path / "cuda"), step=1, model=model)
    calls = {"n": 0}
    real = execute.assemble

    def crashing(*args, **kw):
        calls["n"] += 1
        if calls["n"] > 5:
            raise RuntimeError("disk on fire")
        return real(*args, **kw)

    monkeypatch.setattr(execute, "assemble", crashing)
    dst = tmp_path / "dst"
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert(
            str(tmp_path / "cuda"),
            str(dst),
            ConvertOptions(to="cuda", format=fmt, config=model.config.to_dict()),
            RunOptions(flush_bytes=1),
        )
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers == ["cuda"] or (
        fmt == "ckpt" and not (dst / "manifest.json").exists() and not list(dst.glob("*.safetensors"))
    )
