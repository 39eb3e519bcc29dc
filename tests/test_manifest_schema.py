"""docs/manifest.schema.json against the code: every writer's manifest validates, and the schema refuses what
``Manifest.from_json`` refuses, so that the spec and the code cannot drift apart silently.

Writers covered: ``ckpt.save`` on one rank and on two gloo ranks (FSDP2), the NeuronCheckpointer (two TP ranks),
the asynchronous CheckpointManager, ``StreamingWriter``, ``ckpt convert`` (CUDA and Neuron layout) and the NxD tag
importer.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from conftest import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from manifest_schema import assert_valid, schema, schema_errors

import ckpt
from ckpt.errors import ManifestError
from ckpt.format.manifest import BACKENDS, MANIFEST_NAME, ROLES, Box, Manifest, check_relpath, seal

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "nxd" / "llama_gqa_h64"


class Loader:
    def __init__(self, rank: int = 0) -> None:
        self.state = {"epoch": 2, "batch": 5 + rank, "order": (1, 0)}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def _model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).pow(2).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def rich(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One rank, everything a training loop saves: model, AdamW, scheduler, GradScaler, data loader, tokenizer, user."""
    d = tmp_path_factory.mktemp("rich")
    model, opt = _model_and_optimizer()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    tok = d / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    ckpt.save(
        str(d / "c"),
        step=7,
        model=model,
        optimizer=opt,
        scheduler=sched,
        scaler=scaler,
        dataloader=Loader(),
        tokenizer=str(tok),
        progress={"tokens": 99},
        metadata={
            "run": "schema",
            3: (1.5, float("nan")),
            "b": b"\x01",
            "t": torch.ones(2, dtype=torch.bfloat16),
        },
    )
    return d / "c"


def test_single_rank_save_validates(rich: Path) -> None:
    doc = assert_valid(rich, full=True)
    assert doc["optimizer"]["param_groups"] and doc["scheduler"] and doc["scaler"] and doc["tokenizer"]
    assert set(doc["rng"]["0"]) >= {"python", "numpy", "torch"} and doc["data"]["0"]


def test_adapter_only_save_validates(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    model[0].requires_grad_(False)  # the "base"; the rest is the adapter
    ckpt.save(
        str(tmp_path / "a"), step=3, model=model, optimizer=opt, adapter_only=True, base_source="base/x"
    )
    doc = assert_valid(tmp_path / "a")
    assert doc["adapter"]["base"]["source"] == "base/x" and not any(
        n.startswith("0.") for n in doc["tensors"]
    )


def _two_rank_job(rank: int, world: int, tmp: str) -> None:
    """FSDP2 state through ckpt.save, then TP shards of NxD-named parameters through the NeuronCheckpointer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckpt.neuron import NeuronCheckpointer

    model, _ = _model_and_optimizer()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    ckpt.save(f"{tmp}/fsdp", step=1, model=model, optimizer=opt, dataloader=Loader(rank))

    params = {  # TP-local: 4 of q_proj's 8 rows; the norm is replicated
        "model.layers.0.self_attn.q_proj.weight": torch.nn.Parameter(torch.full((4, 8), float(rank))),
        "model.norm.weight": torch.nn.Parameter(torch.ones(8)),
    }
    holder = torch.nn.Module()
    for name, p in params.items():
        *path, leaf = name.split(".")
        mod = holder
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, p)
    nopt = torch.optim.SGD(holder.parameters(), lr=0.1, momentum=0.9)
    for p in holder.parameters():
        p.grad = torch.ones_like(p)
    nopt.step()
    saver = NeuronCheckpointer(tp_rank=rank, tp_size=world, rule_set="nxd-llama")
    saver.save(f"{tmp}/neuron", step=2, model=holder, optimizer=nopt).result()
    saver.close()


def test_two_gloo_ranks_fsdp2_and_neuron_checkpointer_validate(tmp_path: Path) -> None:
    run_ranks(_two_rank_job, 2, str(tmp_path))
    fsdp = assert_valid(tmp_path / "fsdp", full=True)
    assert fsdp["layout"]["kind"] == "dtensor" and fsdp["layout"]["mesh"]["shape"] == [2]
    assert sorted(fsdp["data"]) == ["0", "1"] and {f["rank"] for f in fsdp["files"].values()} == {0, 1}
    neuron = assert_valid(tmp_path / "neuron", full=True)
    assert neuron["layout"]["kind"] == "nxd" and neuron["extra"]["nxd"]["rule_set"] == "nxd-llama"
    q = neuron["tensors"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["shape"] == [8, 8] and q["partition"] == {"dim": 0, "stride": 1, "tp": 2, "source": "nxd-llama"}
    assert neuron["tensors"]["optim/model.layers.0.self_attn.q_proj.weight/momentum_buffer"]["partition"]


def test_async_manager_validates(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    with ckpt.CheckpointManager(str(tmp_path), async_save=True, codec="zstd") as mgr:
        mgr.save(5, model=model, optimizer=opt).result()
    doc = assert_valid(tmp_path / "step_00000005", full=True)
    assert {s["codec"] for t in doc["tensors"].values() for s in t["shards"]} == {"zstd"}


def test_streaming_writer_validates(tmp_path: Path) -> None:
    from ckpt.saving.writer import StreamingWriter

    w = StreamingWriter(str(tmp_path / "c"), codec="zstd", flush_bytes=64, chunk_bytes=40)
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    part = {"dim": 0, "stride": 1, "tp": 2, "source": "nxd-llama"}
    w.add("w", full[:3], shape=(6, 8), box=Box((0, 0), (3, 8)), partition=part)
    w.add("w", full[3:], shape=(6, 8), box=Box((3, 0), (3, 8)), partition=part)
    w.add("optim/w/exp_avg", full, role="optimizer_state", param="w", key="exp_avg", partition=part)
    w.add("flag", torch.tensor([True, False]), role="buffer")
    trees = {"optimizer": {"type": "x.Opt", "param_groups": [{"lr": 0.1, "params": ["w"]}], "state": {}}}
    w.commit(step=4, backend="neuron", trees={**trees, "extra": {"anything": [1, 2]}})
    doc = assert_valid(tmp_path / "c", full=True)
    assert len(doc["tensors"]["w"]["shards"]) >= 4 and len(doc["files"]) >= 2


def _convert(src: Path, dst: Path, *args: str) -> None:
    from ckpt.cli.convert import convert as convert_cmd

    r = CliRunner().invoke(convert_cmd, [str(src), str(dst), *args])
    assert r.exit_code == 0, r.output


def test_convert_outputs_validate(tmp_path: Path) -> None:
    tag = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
    config = str(FIX / "config.json")
    _convert(tag, tmp_path / "cuda", "--from", "neuron", "--to", "cuda", "--config", config)
    cuda = assert_valid(tmp_path / "cuda")
    assert cuda["extra"]["converted_from"]["layout"] == "neuron" and cuda["optimizer"]
    _convert(tmp_path / "cuda", tmp_path / "neuron", "--to", "neuron", "--tp", "2", "--pp", "2")
    neuron = assert_valid(tmp_path / "neuron", full=True)
    assert neuron["layout"]["kind"] == "nxd" and neuron["extra"]["nxd"]["config"]["hidden_size"] == 64


def test_nxd_tag_import_validates(tmp_path: Path) -> None:
    from ckpt.converters.nxd import import_tag

    config = json.loads((FIX / "config.json").read_text())
    import_tag(FIX / "nxd_train_tp2_dp2_zero1_xser" / "step_3", str(tmp_path / "train"), config=config)
    train = assert_valid(tmp_path / "train")
    assert train["extra"]["nxd"]["source"]["zero1"] is True and train["layout"]["zero_stage"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NxD's converter writes no 'done' marker
        import_tag(FIX / "nxd_from_full_tp2_pp2", str(tmp_path / "pp"), allow_unmarked=True, step=3)
    pp = assert_valid(tmp_path / "pp")
    assert pp["extra"]["nxd"]["pp_ranks"]["model.norm.weight"] == [1] and pp["extra"]["nxd"]["config"] is None


# ------------------------------------------------------------------------------ the schema refuses what the code does


def _tensor(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["tensors"]["0.weight"]


def _shard(doc: dict[str, Any]) -> dict[str, Any]:
    return _tensor(doc)["shards"][0]


def _set(get: Callable[[dict[str, Any]], dict[str, Any]], key: str, value: Any) -> Callable[[dict], None]:
    return lambda doc: get(doc).__setitem__(key, value)


def _drop(get: Callable[[dict[str, Any]], dict[str, Any]], key: str) -> Callable[[dict], None]:
    return lambda doc: get(doc).pop(key)


def _top(doc: dict[str, Any]) -> dict[str, Any]:
    return doc


def _rename_file(doc: dict[str, Any], bad: str) -> None:
    name = _shard(doc)["file"]
    doc["files"][bad] = doc["files"].pop(name)
    for t in doc["tensors"].values():
        for s in t["shards"]:
            if s["file"] == name:
                s["file"] = bad


MUTATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "format other": _set(_top, "format", "other"),
    "format_version 0": _set(_top, "format_version", 0),
    "format_version string": _set(_top, "format_version", "1"),
    "step bool": _set(_top, "step", True),
    "step negative": _set(_top, "step", -1),
    "step string": _set(_top, "step", "7"),
    "no step": _drop(_top, "step"),
    "no backend": _drop(_top, "backend"),
    "backend tpu": _set(_top, "backend", "tpu"),
    "no layout": _drop(_top, "layout"),
    "no files": _drop(_top, "files"),
    "no tensors": _drop(_top, "tensors"),
    "tensors list": _set(_top, "tensors", []),
    "created_at number": _set(_top, "created_at", 5),
    "optimizer number": _set(_top, "optimizer", 5),
    "tokenizer list": _set(_top, "tokenizer", []),
    "rng list": _set(_top, "rng", []),
    "extra string": _set(_top, "extra", "x"),
    "adapter list": _set(_top, "adapter", []),
    "adapter without base digest": _set(_top, "adapter", {"base": {"source": "x"}}),
    "adapter base digest a number": _set(_top, "adapter", {"base": {"digest": 3}}),
    "adapter rank_digests string": _set(
        _top, "adapter", {"base": {"digest": "xxh3_128:" + "0" * 32, "rank_digests": "x"}}
    ),
    "layout.tp string": _set(lambda d: d["layout"], "tp", "2"),
    "layout.dp negative": _set(lambda d: d["layout"], "dp", -1),
    "layout.mesh number": _set(lambda d: d["layout"], "mesh", 5),
    "layout.kind number": _set(lambda d: d["layout"], "kind", 3),
    "file entry without size": lambda d: next(iter(d["files"].values())).pop("size"),
    "file entry rank negative": lambda d: next(iter(d["files"].values())).__setitem__("rank", -1),
    "file entry not an object": lambda d: d["files"].__setitem__(_shard(d)["file"], 12),
    "file name escapes": lambda d: _rename_file(d, "../x.safetensors"),
    "file name absolute": lambda d: _rename_file(d, "/x.safetensors"),
    "file name with backslash": lambda d: _rename_file(d, "a\\b.safetensors"),
    "file name with ':'": lambda d: _rename_file(d, "c:x"),
    "file name not normalised": lambda d: _rename_file(d, "a//b"),
    "file name with control char": lambda d: _rename_file(d, "a\nb"),
    "tensor not an object": lambda d: d["tensors"].__setitem__("0.weight", [1]),
    "unknown role": _set(_tensor, "role", "weights"),
    "no role": _drop(_tensor, "role"),
    "unknown dtype": _set(_tensor, "dtype", "F128"),
    "dtype lowercase": _set(_tensor, "dtype", "f32"),
    "no shape": _drop(_tensor, "shape"),
    "shape string": _set(_tensor, "shape", "5,6"),
    "shape negative": _set(_tensor, "shape", [-5, 6]),
    "shape rank 65": _set(_tensor, "shape", [1] * 65),
    "param number": _set(_tensor, "param", 5),
    "key list": _set(_tensor, "key", ["exp_avg"]),
    "partition list": _set(_tensor, "partition", [0]),
    "shards object": _set(_tensor, "shards", {}),
    "shard not an object": _set(_tensor, "shards", ["x"]),
    "shard without checksum": _drop(_shard, "checksum"),
    "shard without file": _drop(_shard, "file"),
    "shard without offsets": _drop(_shard, "offsets"),
    "shard offset negative": _set(_shard, "offset", -1),
    "shard nbytes float": _set(_shard, "nbytes", 120.5),
    "shard lengths strings": _set(_shard, "lengths", ["5", "6"]),
    "codec lz4": _set(_shard, "codec", "lz4"),
    "checksum md5": _set(_shard, "checksum", "md5:0123456789abcdef"),
    "checksum not hex": _set(_shard, "checksum", "xxh3_64:0123456789abcdeg"),
    "checksum upper case": _set(_shard, "checksum", "xxh3_64:0123456789ABCDEF"),
    "checksum short": _set(_shard, "checksum", "xxh3_64:0123"),
}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A format v1 manifest document without optimizer (its tensor names are the model's: '0.weight', ...).

    v1 pinned: the mutations below edit v1's members (shards inside tensors); v2's own members are tested in
    tests/test_manifest_v2.py."""
    d = tmp_path_factory.mktemp("plain")
    model, _ = _model_and_optimizer()
    ckpt.Checkpointer(async_save=False, format_version=1).save(str(d / "c"), step=7, model=model).result()
    return json.loads((d / "c" / MANIFEST_NAME).read_text())


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_schema_refuses_what_the_code_refuses(plain: dict[str, Any], mutation: str) -> None:
    doc = copy.deepcopy(plain)
    MUTATIONS[mutation](doc)
    with pytest.raises(ManifestError):
        Manifest.from_json(seal(doc), "manifest.json")
    assert schema_errors(doc), f"the schema accepts a manifest the code refuses ({mutation})"


def test_schema_requires_the_checksum(plain: dict[str, Any]) -> None:
    doc = copy.deepcopy(plain)
    del doc["checksum"]
    with pytest.raises(ManifestError, match="checksum is missing"):
        Manifest.from_json(json.dumps(doc, separators=(",", ":")), "manifest.json")
    assert any("'checksum' is a required property" in e for e in schema_errors(doc))


def test_unknown_members_are_allowed_by_both(plain: dict[str, Any]) -> None:
    """docs/format.md: unknown keys are ignored (a later minor addition must not break older readers)."""
    doc = copy.deepcopy(plain)
    doc["future"] = {"x": 1}
    doc["layout"]["future"] = 2
    _tensor(doc)["future"] = 3
    _shard(doc)["future"] = 4
    next(iter(doc["files"].values()))["future"] = 5
    Manifest.from_json(seal(doc))
    assert schema_errors(doc) == []


def test_schema_enums_are_the_codes_constants() -> None:
    from ckpt.format.codecs import CODECS
    from ckpt.format.dtypes import dtype_name

    defs = schema()["$defs"]
    assert tuple(defs["tensor"]["properties"]["role"]["enum"]) == ROLES
    assert tuple(schema()["properties"]["backend"]["enum"]) == BACKENDS
    assert tuple(defs["shard"]["properties"]["codec"]["enum"]) == CODECS
    storable = set()
    for attr in dir(torch):
        dt = getattr(torch, attr)
        if isinstance(dt, torch.dtype):
            try:
                storable.add(dtype_name(dt))
            except ManifestError:
                pass
    assert set(defs["dtype"]["enum"]) == storable


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="a./\\:\x01 é", max_size=9))
def test_file_name_pattern_is_check_relpath(name: str) -> None:
    """The schema's file-name pattern accepts exactly the names ``check_relpath`` accepts."""
    pattern = schema()["$defs"]["relpath"]["pattern"]
    try:
        check_relpath(name, "test")
        code_ok = True
    except ManifestError:
        code_ok = False
    assert (re.search(pattern, name) is not None) == code_ok, name
