"""NxD-native output streams one (tp, pp) rank at a time: same bytes as the in-memory path, bounded memory.

* ``write_nxd`` (``ckpt convert --format nxd``) and ``export_tag`` write every file byte for byte like the
  in-memory path (the whole tag built first, tensor by tensor, then ``write_tag``), on the fixtures, plain and xser,
  ZeRO-1 re-sharded and plain optimizers.
* Memory: a child process converts generated models with 2 and 6 pipeline ranks of the same per-rank size; the
  peak RSS growth during the write (``VmHWM`` after resetting it via ``/proc/self/clear_refs``) must not grow with
  the number of ranks, while the in-memory path measured the same way does (so the measurement can tell).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt.converters import nxd
from ckpt.converters.ckpt import ManifestSource
from ckpt.converters.convert import ConvertOptions, convert, load_config
from ckpt.converters.engine import Conversion, plan_to_neuron, produce, run_serial
from ckpt.converters.nxd.export import NxdExport
from ckpt.converters.nxd.reader import NxdTag, NxdTagMeta
from ckpt.converters.nxd.writer import TagWriter

from ckpt.format import treecodec
from ckpt.format.reader import CheckpointReader
from ckpt.layouts import LayoutSpec, ModelDims, bit_equal
from ckpt.saving.writer import StreamingWriter

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "nxd" / "llama_gqa_h64"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_same_files(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    assert len([n for n in fa if n.startswith("model/")]) >= 1
    differ = [n for n in fa if fa[n] != fb[n]]
    assert not differ, f"files differ: {differ}"


# ------------------------------------------------------------------------------------------ in-memory reference


def write_nxd(conv: Conversion, dst: Path, *, xser: bool = False) -> Path:
    """``ckpt convert --format nxd``'s streaming path, one process."""
    run_serial(NxdExport(conv, xser=xser), str(dst))
    return dst


def reference_write_nxd(conv: Conversion, dst: Path, *, xser: bool = False) -> Path:
    """The in-memory algorithm: tensor-major over the plan, the whole tag in memory, then ``write_tag`` (views
    copied, as the streaming writer does, so a rank file holds its rows only)."""
    from ckpt.converters.nxd.discovery import TagStatus

    flags = conv.flags
    assert flags is not None
    models: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
    optims: dict[tuple[int, int, int], dict[str, Any]] = {}
    for out in conv.tensors:
        d = out.desc
        for part in out.parts:
            data = produce(conv, part)
            if (
                not data.is_contiguous()
                or data.untyped_storage().nbytes() != data.numel() * data.element_size()
            ):
                data = data.contiguous().clone()
            for tp, pp in part.ranks:
                key = (tp, pp, 0)
                if d.role != "optimizer_state":
                    models.setdefault(key, {})[d.name] = data
                    continue
                o = optims.setdefault(
                    key, {"state": {}, "param_groups": [], "master_weights": None, "extra": {}}
                )
                if d.key == "master_weight":
                    o["master_weights"] = o["master_weights"] or {}
                    o["master_weights"][d.param] = data
                else:
                    o["state"].setdefault(d.param, {})[d.key] = data
    opt = conv.trees.optimizer
    if opt is not None:
        for key, o in optims.items():
            names = set(models[key])
            for p, per in opt.get("state", {}).items():
                if p in names:
                    o["state"].setdefault(p, {}).update({k: treecodec.decode(v) for k, v in per.items()})
            o["param_groups"] = [
                {
                    **{k: treecodec.decode(v) for k, v in g.items() if k != "params"},
                    "params": [p for p in g["params"] if p in names],
                }
                for g in opt.get("param_groups", [])
            ]
            order = [n for g in o["param_groups"] for n in g["params"]]
            o["state"] = {n: o["state"][n] for n in order if n in o["state"]}
    dp = flags.dp if conv.zero1 else 1
    meta = NxdTagMeta(
        path=dst, name=dst.name, step=conv.trees.step, status=TagStatus.COMPLETE, tp_size=flags.tp,
        pp_size=flags.pp, dp_size=dp, ep_size=1, xser=xser, zero1=conv.zero1, legacy=False,
    )  # fmt: skip
    tag = NxdTag(
        meta=meta,
        per_rank_model=models,
        per_rank_optimizer=optims,
        scheduler=treecodec.decode(conv.trees.scheduler) if conv.trees.scheduler is not None else None,
        user_content=treecodec.decode(conv.trees.user) if conv.trees.user is not None else None,
    )
    return nxd.write_tag(tag, dst.parent, dst.name, xser=xser, dp_size=dp, zero1=conv.zero1)


# ------------------------------------------------------------------------------------------ byte identity


@pytest.fixture(scope="module")
def config() -> dict:
    return load_config(str(FIX / "config.json"))


@pytest.fixture(scope="module")
def cuda_train(tmp_path_factory: pytest.TempPathFactory, config: dict) -> Path:
    out = tmp_path_factory.mktemp("stream") / "cuda"
    convert(
        str(FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"),
        str(out),
        ConvertOptions(to="cuda", config=config),
    )
    return out


@pytest.mark.parametrize(
    "flags,xser",
    [
        (dict(tp=2, dp=2, qkv_linear=True), False),  # the training fixture's own layout, ZeRO-1
        (dict(tp=2, pp=2, dp=3), True),  # PP, ZeRO-1 re-sharded with padding, xser
        (dict(tp=1, pp=4, dp=1), False),  # plain torch.optim optimizer files
        (dict(tp=4, qkv_linear=True, kv_size_multiplier=2, hw="trn2"), False),  # KV replicas
    ],
)
def test_write_nxd_same_bytes_as_in_memory(
    cuda_train: Path, config: dict, tmp_path: Path, flags: dict, xser: bool
) -> None:
    spec = LayoutSpec.from_hf_config(config, **flags)
    conv = plan_to_neuron(ManifestSource(str(cuda_train)), spec.flags(), config=config)
    got = write_nxd(conv, tmp_path / "stream" / "step_3", xser=xser)
    want = reference_write_nxd(conv, tmp_path / "memory" / "step_3", xser=xser)
    _assert_same_files(got, want)


def test_write_nxd_model_files_equal_nxd_own_files(cuda_train: Path, config: dict, tmp_path: Path) -> None:
    """Same layout as the NxD training fixture: the model rank files are NxD's own bytes (no view storage)."""
    spec = LayoutSpec.from_hf_config(config, tp=2, dp=2, qkv_linear=True)
    conv = plan_to_neuron(ManifestSource(str(cuda_train)), spec.flags(), config=config)
    got = write_nxd(conv, tmp_path / "step_3")
    orig = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3" / "model"
    for f in sorted(orig.iterdir()):
        assert (got / "model" / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory, config: dict) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for case, rel in {
        "train_xser": "nxd_train_tp2_dp2_zero1_xser/step_3",
        "pp2": "nxd_from_full_tp2_pp2",
    }.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # converter output is unmarked
            nxd.import_tag(FIX / rel, str(root / case), allow_unmarked=True, step=3, config=config)
        out[case] = root / case
    return out


@pytest.mark.parametrize(
    "case,kw",
    [
        ("train_xser", {}),
        ("train_xser", dict(dp_size=3, xser=False)),
        ("train_xser", dict(zero1=False)),
        ("pp2", {}),
    ],
)
def test_export_same_bytes_as_in_memory(
    imported: dict[str, Path], tmp_path: Path, case: str, kw: dict
) -> None:
    got = nxd.export_tag(str(imported[case]), tmp_path / "stream", "step_3", **kw)
    reader = CheckpointReader(str(imported[case]))
    tag = nxd.manifest_to_tag(reader, name="step_3", dp_size=kw.get("dp_size"))
    want = nxd.write_tag(
        tag, tmp_path / "memory", "step_3", xser=kw.get("xser", tag.meta.xser), dp_size=tag.meta.dp_size,
        zero1=kw.get("zero1"),
    )  # fmt: skip
    _assert_same_files(got, want)
    # and every model file holds exactly rank_shards' (independent, tensor-major) tensors
    shards = nxd.rank_shards(reader)
    back = nxd.read_tag(got)
    assert sorted(back.per_rank_model) == sorted((t, p, 0) for t, p in shards)
    for (t, p), sd in shards.items():
        assert list(back.per_rank_model[(t, p, 0)]) == list(sd)
        assert all(bit_equal(back.per_rank_model[(t, p, 0)][n], v) for n, v in sd.items())


def test_export_hands_the_writer_one_rank_at_a_time(
    imported: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank is built, written and released before the next one is read (weak references die in between)."""
    import weakref

    alive: list[weakref.ref] = []
    calls: list[tuple[tuple[int, int, int], int]] = []
    real = TagWriter.write_rank

    def spy(self: TagWriter, rank: Any, model: Any, optimizer: Any = None, **kw: Any) -> None:
        calls.append((rank, sum(1 for r in alive if r() is not None)))
        real(self, rank, model, optimizer, **kw)
        alive.extend(weakref.ref(t) for t in model.values())

    monkeypatch.setattr(TagWriter, "write_rank", spy)
    nxd.export_tag(str(imported["pp2"]), tmp_path, "step_3")
    assert [r for r, _ in calls] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert all(n == 0 for _, n in calls), calls  # no earlier rank's tensor is alive when the next is written


# ------------------------------------------------------------------------------------------ memory bound

HIDDEN, HEADS, INTER, VOCAB = 384, 6, 1024, 64

_CHILD = r"""
import json, re, sys
from pathlib import Path
mode, src, dst, pp = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, sys.argv[5])
from ckpt.converters import nxd
from ckpt.converters.ckpt import ManifestSource
from ckpt.converters.engine import plan_to_neuron
from ckpt.layouts.spec import NxdFlags
from ckpt.format.reader import CheckpointReader
from tests.test_nxd_streaming import reference_write_nxd, write_nxd

def status(key):
    return int(re.search(key + r":\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

if mode.startswith("nxd"):
    src_ = ManifestSource(src)
    conv = plan_to_neuron(src_, NxdFlags(tp=1, pp=pp, dp=2), config=src_.config)
    run = (lambda: write_nxd(conv, dst)) if mode == "nxd" else (lambda: reference_write_nxd(conv, dst))
else:
    reader = CheckpointReader(src)
    if mode == "export":
        run = lambda: nxd.export_tag(src, dst.parent, dst.name)
    else:
        run = lambda: nxd.write_tag(nxd.manifest_to_tag(reader, name=dst.name), dst.parent, dst.name)
Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
before = status("VmRSS")
run()
print(json.dumps({"growth": status("VmHWM") - before}))
"""


def _llama(layers: int) -> dict:
    return {
        "model_type": "llama", "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "head_dim": HIDDEN // HEADS, "num_hidden_layers": layers, "vocab_size": VOCAB,
        "intermediate_size": INTER, "tie_word_embeddings": False,
    }  # fmt: skip


def _layer_bytes() -> int:
    """fp32 bytes of one decoder layer with two Adam moments: one pipeline rank's state here (1 layer per rank)."""
    params = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN
    return 3 * 4 * params


def _write_cuda(path: Path, layers: int) -> None:
    """A CUDA-layout checkpoint (HF names, fp32, exp_avg/exp_avg_sq, one param group) of a generated Llama."""
    g = torch.Generator().manual_seed(layers)
    shapes = ModelDims.from_hf_config(_llama(layers)).hf_shapes()
    w = StreamingWriter(str(path))
    for n, s in shapes.items():
        w.add(n, torch.randn(s, generator=g))
        for key in ("exp_avg", "exp_avg_sq"):
            w.add(f"optim/{n}/{key}", torch.randn(s, generator=g), role="optimizer_state", param=n, key=key)
    opt = {
        "type": "torch.optim.adamw.AdamW",
        "param_groups": [{"lr": 0.001, "params": list(shapes)}],
        "state": {n: {"step": treecodec.encode(torch.tensor(3.0))} for n in shapes},
    }
    w.commit(step=3, backend="cuda", trees={"optimizer": opt, "extra": {"config": _llama(layers)}})


def _growth(mode: str, src: Path, dst: Path, pp: int) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072", MALLOC_ARENA_MAX="2")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(src), str(dst), str(pp), str(ROOT)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return int(json.loads(out.stdout.strip().splitlines()[-1])["growth"])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
@pytest.mark.parametrize("path", ["nxd", "export"])
def test_peak_memory_is_one_rank_not_the_model(tmp_path: Path, path: str) -> None:
    """Peak RSS growth while writing 2 vs 6 PP ranks of one layer each (ZeRO-1 over dp 2) stays the same; the
    in-memory path, measured the same way, grows by the extra ranks' state."""
    srcs = {}
    for pp in (2, 6):
        _write_cuda(tmp_path / f"cuda{pp}", pp)
        srcs[pp] = tmp_path / f"cuda{pp}"
        if path == "export":
            convert(str(srcs[pp]), str(tmp_path / f"neuron{pp}"), ConvertOptions.neuron(pp=pp, dp=2))
            srcs[pp] = tmp_path / f"neuron{pp}"
    rank = _layer_bytes()
    small = _growth(path, srcs[2], tmp_path / "o2" / "step_3", 2)
    big = _growth(path, srcs[6], tmp_path / "o6" / "step_3", 6)
    memory = _growth(f"{path}_inmem", srcs[6], tmp_path / "m6" / "step_3", 6)
    report = f"{path}: rank {rank / 2**20:.1f} MiB; streaming pp2 {small / 2**20:.1f} MiB, pp6 {big / 2**20:.1f} MiB; in-memory pp6 {memory / 2**20:.1f} MiB"
    print(report)
    assert big < small + rank // 2, report  # 4 more ranks cost < half a rank
    assert big < 3 * rank, report  # one rank + its ZeRO-1 shards + the read cache
    assert memory > big + 3 * rank, report  # the measurement sees a whole-tag writer
