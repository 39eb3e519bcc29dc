"""The golden checkpoints of format v1 (fixtures/golden/v1/, see its README) still read exactly as written.

Nothing here regenerates them.  Expected values are stated independently of ``make_v1.py``: literal trees,
names and shapes, and the tensor formula below.  A failure means a change broke format v1 (see the README).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from click.testing import CliRunner
from manifest_schema import assert_valid

import ckpt
from ckpt.format import treecodec
from ckpt.format.manifest import MANIFEST_NAME, Manifest
from ckpt.format.reader import CheckpointReader
from ckpt.state.tokenizer import identity

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden" / "v1"
STEP_DIR = "step_00000003"
CASES = ("single", "sharded", "nxd")

# ------------------------------------------------------------------------------------------ what was saved

TABLE: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (16, 8))]
for _layer in range(2):
    _p = f"model.layers.{_layer}"
    TABLE += [
        (f"{_p}.self_attn.q_proj.weight", (8, 8)),
        (f"{_p}.self_attn.k_proj.weight", (4, 8)),
        (f"{_p}.self_attn.v_proj.weight", (4, 8)),
        (f"{_p}.self_attn.o_proj.weight", (8, 8)),
        (f"{_p}.mlp.gate_proj.weight", (12, 8)),
        (f"{_p}.mlp.up_proj.weight", (12, 8)),
        (f"{_p}.mlp.down_proj.weight", (8, 12)),
        (f"{_p}.input_layernorm.weight", (8,)),
        (f"{_p}.post_attention_layernorm.weight", (8,)),
    ]
TABLE += [("model.norm.weight", (8,)), ("lm_head.weight", (16, 8))]

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8,
    "intermediate_size": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 2,
    "num_hidden_layers": 2,
    "vocab_size": 16,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-06,
    "torch_dtype": "float32",
}


def value(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    k = torch.arange(math.prod(shape), dtype=torch.int64)
    return (((k * (2 * seed + 3) + 7 * seed) % 61 - 30).to(torch.float32) / 32).reshape(shape)


def full_tensors() -> dict[str, torch.Tensor]:
    """Every logical tensor of the single/sharded goldens (HF names), by formula."""
    out: dict[str, torch.Tensor] = {}
    for i, (name, shape) in enumerate(TABLE):
        out[name] = value(i, shape)
        out[f"optim/{name}/exp_avg"] = value(100 + i, shape)
        out[f"optim/{name}/exp_avg_sq"] = value(200 + i, shape).abs()
    return out


def nxd_tensors() -> dict[str, torch.Tensor]:
    """The nxd golden's logical tensors: TP=2 shards of the same values concatenated in rank order.

    For this config (4 query heads, 2 KV heads, TP 2, trn1) every split keeps the HF order, except the fused
    ``gate_up_proj``, whose TP rank r holds [gate rows of r; up rows of r]."""
    full = full_tensors()
    out: dict[str, torch.Tensor] = {}
    for prefix in ("", "optim/"):
        for suffix in ("/exp_avg", "/exp_avg_sq") if prefix else ("",):
            for name, _ in TABLE:
                if ".up_proj." in name:
                    continue
                if ".gate_proj." in name:
                    gate = full[f"{prefix}{name}{suffix}"]
                    up = full[f"{prefix}{name.replace('gate_proj', 'up_proj')}{suffix}"]
                    fused = torch.cat([gate[:6], up[:6], gate[6:], up[6:]])
                    out[f"{prefix}{name.replace('gate_proj', 'gate_up_proj')}{suffix}"] = fused
                else:
                    out[f"{prefix}{name}{suffix}"] = full[f"{prefix}{name}{suffix}"]
    return out


def nxd_names() -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(t.shape)) for n, t in nxd_tensors().items() if not n.startswith("optim/")]


PARTITIONS = {  # NxD name pattern -> partition of the nxd golden
    "embed_tokens": {"dim": 0, "stride": 1, "tp": 2, "source": "nxd-llama"},
    "q_proj": {"dim": 0, "stride": 1, "tp": 2, "source": "nxd-llama"},
    "k_proj": {"dim": 0, "stride": 1, "tp": 2, "source": "nxd-llama"},
    "v_proj": {"dim": 0, "stride": 1, "tp": 2, "source": "nxd-llama"},
    "o_proj": {"dim": 1, "stride": 1, "tp": 2, "source": "nxd-llama"},
    "gate_up_proj": {"dim": 0, "stride": 2, "tp": 2, "source": "nxd-llama"},
    "down_proj": {"dim": 1, "stride": 1, "tp": 2, "source": "nxd-llama"},
    "lm_head": {"dim": 0, "stride": 1, "tp": 2, "source": "nxd-llama"},
}

GROUP = {
    "lr": 0.0005,
    "betas": {"$t": [0.9, 0.95]},
    "eps": 1e-08,
    "amsgrad": False,
    "maximize": False,
    "foreach": False,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
    "initial_lr": 0.001,
}
STEP_TENSOR = {"$tensor": {"dtype": "F32", "shape": [], "data": "AABAQA=="}}  # tensor(3.0)
SCHEDULER = {
    "step_size": 2,
    "gamma": 0.5,
    "base_lrs": [0.001, 0.001],
    "last_epoch": 3,
    "_step_count": 4,
    "_is_initial": False,
    "_get_lr_called_within_step": False,
    "_last_lr": [0.0005, 0.0005],
}
SCALER = {
    "scale": 512.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 7,
    "_growth_tracker": 0,
}
TOKENIZER_FILES = {
    "tokenizer.json": '{"model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2}}}\n',
    "tokenizer_config.json": '{"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}\n',
}
TOKENIZER = {
    "name": "golden-tok",
    "revision": None,
    "sha256": "27ee763c0cdecf964475504f5d9f0573007aa583edf7101746c82feae28578de",
    "files": ["tokenizer.json", "tokenizer_config.json"],
}
PROGRESS = {"step": 3, "samples": 12, "tokens": 384}
USER_ENCODED = {
    "$d": [
        ["run", "golden-v1"],
        ["seeds", {"$t": [1, 2]}],
        ["lr", 0.0003],
        ["nan", {"$f": "nan"}],
        ["neg_inf", {"$f": "-inf"}],
        [7, "int key"],
        ["$dollar", "a key that looks like a tag"],
        ["bytes", {"$b": "AP9ja3B0"}],
        ["mask", {"$tensor": {"dtype": "BOOL", "shape": [3], "data": "AQAB"}}],
        ["bf16", {"$tensor": {"dtype": "BF16", "shape": [2], "data": "wD8AwA=="}}],
        [
            "ids",
            {
                "$tensor": {
                    "dtype": "I64",
                    "shape": [4],
                    "data": "AAAAAAAAAAABAAAAAAAAAAIAAAAAAAAAAwAAAAAAAAA=",
                }
            },
        ],
        ["np", {"$np": {"dtype": "<i4", "shape": [2, 3], "data": "AAAAAAEAAAACAAAAAwAAAAQAAAAFAAAA"}}],
        ["dtype", {"$dtype": "F16"}],
        ["nested", {"a": [1, {"$t": [2, 3.25]}], "b": None}],
    ]
}
NXD_EXTRA = {
    "nxd": {
        "rule_set": "nxd-llama",
        "kv_size_multiplier": 1,
        "hw": "trn1",
        "virtual_pp": 1,
        "fuse_qkv": False,
        "qkv_linear": False,
        "config": CONFIG,
    }
}
LAYOUTS = {
    "single": {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "ep": 1, "zero_stage": 0, "mesh": None, "kind": "replicated"},
    "sharded": {
        "world_size": 2, "tp": 1, "pp": 1, "dp": 2, "ep": 1, "zero_stage": 0,
        "mesh": {"shape": [2], "dim_names": []}, "kind": "dtensor",
    },
    "nxd": {"world_size": 2, "tp": 2, "pp": 1, "dp": 1, "ep": 1, "zero_stage": 0, "mesh": None, "kind": "nxd"},
}  # fmt: skip


def loader_state(rank: int) -> dict[str, Any]:
    return {"epoch": 1, "batch": 7 + rank, "order": (3, 0, 2, 1), "seed": 1234, "exhausted": False}


class Loader:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def path_of(case: str) -> Path:
    return GOLDEN / case / STEP_DIR


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), name
    assert bits(got) == bits(want), name


def build_model(shapes: list[tuple[str, tuple[int, ...]]]) -> torch.nn.Module:
    """A fresh module with parameters ``shapes`` (NaN-filled, so that a missed tensor cannot pass)."""
    root = torch.nn.Module()
    for name, shape in shapes:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, float("nan"))))
    return root


def build_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    return torch.optim.AdamW(
        [{"params": [p for _, p in named if p.dim() > 1]}, {"params": [p for _, p in named if p.dim() == 1]}],
        lr=0.1,
    )


def same_tree(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_tree(a[k], b[k]) for k in a)
    return a == b


# ------------------------------------------------------------------------------------------ fixtures


def _fingerprint() -> dict[str, str]:
    return {
        str(p.relative_to(GOLDEN)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in GOLDEN.rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module", autouse=True)
def goldens_stay_untouched() -> Iterator[None]:
    """No test may write into the goldens (a source is never modified)."""
    before = _fingerprint()
    assert len(before) == 8, sorted(before)  # 3 manifests, 5 data files
    yield
    assert _fingerprint() == before


@pytest.fixture
def keep_rng() -> Iterator[None]:
    """Restoring RNG state into this process must not leak into other tests."""
    py, npy, tch = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(tch)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("cfg") / "config.json"
    p.write_text(json.dumps(CONFIG))
    return p


# ------------------------------------------------------------------------------------------ the manifests


@pytest.mark.parametrize("case", CASES)
def test_manifest_seal_verifies_and_schema_validates(case: str) -> None:
    raw = (path_of(case) / MANIFEST_NAME).read_bytes()
    assert raw[13:37].decode() == "xxh3_64:" + xxhash.xxh3_64_hexdigest(b"{" + raw[39:])
    Manifest.from_json(raw, case)  # checks the seal and the structure
    assert_valid(path_of(case))


@pytest.mark.parametrize("case", CASES)
def test_manifest_trees_are_exactly_what_was_saved(case: str) -> None:
    m = CheckpointReader(str(path_of(case))).manifest
    ranks = 1 if case == "single" else 2
    assert (m.format_version, m.step, m.backend) == (1, 3, "neuron" if case == "nxd" else "cpu")
    assert json.loads((path_of(case) / MANIFEST_NAME).read_text())["layout"] == LAYOUTS[case]
    assert m.scheduler == SCHEDULER and m.scaler == SCALER and m.tokenizer == TOKENIZER
    assert m.progress == PROGRESS and m.user == USER_ENCODED
    assert m.data == {
        str(r): {"epoch": 1, "batch": 7 + r, "order": {"$t": [3, 0, 2, 1]}, "seed": 1234, "exhausted": False}
        for r in range(ranks)
    }
    assert m.extra == (NXD_EXTRA if case == "nxd" else {})
    names = [n for n, _ in (nxd_names() if case == "nxd" else TABLE)]
    assert m.optimizer == {
        "type": "torch.optim.adamw.AdamW",
        "param_groups": [
            {**GROUP, "weight_decay": 0.01, "params": [n for n in names if not n.endswith("norm.weight")]},
            {**GROUP, "weight_decay": 0.0, "params": [n for n in names if n.endswith("norm.weight")]},
        ],
        "state": {n: {"step": STEP_TENSOR} for n in names},
    }
    assert sorted(f.rank for f in m.files.values()) == list(range(ranks))
    assert m.environment["world_size"] == ranks and m.environment["versions"]["torch"] == "2.9.0"
    assert datetime.datetime.fromisoformat(m.created_at).utcoffset() == datetime.timedelta(0)
    assert all(f"r{f.rank:05d}-" == p[:7] and p.endswith(".safetensors") for p, f in m.files.items())


def test_user_tree_decodes_to_the_saved_values() -> None:
    m = CheckpointReader(str(path_of("single"))).manifest
    want = {
        "run": "golden-v1",
        "seeds": (1, 2),
        "lr": 0.0003,
        "nan": float("nan"),
        "neg_inf": float("-inf"),
        7: "int key",
        "$dollar": "a key that looks like a tag",
        "bytes": b"\x00\xffckpt",
        "mask": torch.tensor([True, False, True]),
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "ids": torch.arange(4, dtype=torch.int64),
        "np": np.arange(6, dtype=np.int32).reshape(2, 3),
        "dtype": torch.float16,
        "nested": {"a": [1, (2, 3.25)], "b": None},
    }
    assert same_tree(treecodec.decode(m.user), want)


def test_tokenizer_identity_rule_is_unchanged(tmp_path: Path) -> None:
    """The same files hashed today give the sha256 recorded in v1."""
    folder = tmp_path / "golden-tok"
    folder.mkdir()
    for name, text in TOKENIZER_FILES.items():
        (folder / name).write_text(text)
    assert identity(str(folder)) == TOKENIZER


@pytest.mark.parametrize("case", CASES)
def test_rng_records_are_the_seeded_states(case: str) -> None:
    m = CheckpointReader(str(path_of(case))).manifest
    for rank in range(1 if case == "single" else 2):
        rec = treecodec.decode(m.rng[str(rank)])
        assert sorted(rec) == sorted(["python", "numpy", "torch"] + (["xla_seed"] if case == "nxd" else []))
        assert rec["python"] == random.Random(11 + rank).getstate()
        want_np = np.random.RandomState(12 + rank).get_state()
        assert rec["numpy"][0] == want_np[0] and rec["numpy"][2:] == want_np[2:]
        assert np.array_equal(rec["numpy"][1], want_np[1])
        assert torch.equal(rec["torch"], torch.Generator().manual_seed(13 + rank).get_state())
        if case == "nxd":
            assert rec["xla_seed"] == 14 + rank


# ------------------------------------------------------------------------------------------ tensors


@pytest.mark.parametrize("case", CASES)
def test_reader_reads_every_tensor_exactly(case: str) -> None:
    reader = CheckpointReader(str(path_of(case)))
    want = nxd_tensors() if case == "nxd" else full_tensors()
    assert sorted(reader.names()) == sorted(want)
    for name, w in want.items():
        e = reader.entry(name)
        assert (
            e.role == ("optimizer_state" if name.startswith("optim/") else "parameter") and e.dtype == "F32"
        )
        if e.role == "optimizer_state":
            assert (e.param, e.key) == tuple(name[len("optim/") :].rsplit("/", 1))
        assert_bitwise(reader.read(name), w, name)


def test_sharded_golden_holds_dim0_boxes_raw_on_rank0_and_zstd_on_rank1() -> None:
    m = CheckpointReader(str(path_of("sharded"))).manifest
    codec_of = {p: ("raw" if f.rank == 0 else "zstd") for p, f in m.files.items()}
    for name, t in m.tensors.items():
        half = t.shape[0] // 2
        for s in t.shards:
            assert s.codec == codec_of[s.file], name
            assert all(o == 0 for o in s.box.offsets[1:]) and s.box.lengths[1:] == t.shape[1:], name
            rank = m.files[s.file].rank
            assert (
                rank * half <= s.box.offsets[0] and s.box.offsets[0] + s.box.lengths[0] <= (rank + 1) * half
            )
            if s.codec == "raw":
                assert s.nbytes == s.box.numel * 4 <= 128, name
    assert max(len(t.shards) for t in m.tensors.values()) >= 4  # several chunks per shard


def test_nxd_golden_partitions() -> None:
    m = CheckpointReader(str(path_of("nxd"))).manifest
    for name, t in m.tensors.items():
        base = t.param if t.role == "optimizer_state" else name
        kind = next((k for k in PARTITIONS if f".{k}." in f".{base}"), None)
        assert t.partition == (PARTITIONS[kind] if kind else None), name
        if kind is None:
            assert len(t.shards) == 1 and m.files[t.shards[0].file].rank in (0, 1)  # replicated: stored once
        else:
            d = t.partition["dim"]
            boxes = sorted((s.box.offsets[d], s.box.lengths[d], m.files[s.file].rank) for s in t.shards)
            assert boxes == [(0, t.shape[d] // 2, 0), (t.shape[d] // 2, t.shape[d] // 2, 1)], name


# ------------------------------------------------------------------------------------------ restore


def test_single_restores_into_fresh_objects(keep_rng: None) -> None:
    model = build_model(TABLE)
    opt = build_optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    loader = Loader()
    res = ckpt.restore(
        str(path_of("single")), model=model, optimizer=opt, scheduler=sched, scaler=scaler, dataloader=loader
    )
    assert res.step == 3 and res.progress == PROGRESS and res.rng_restored == ["python", "numpy", "torch"]
    assert same_tree(res.metadata, treecodec.decode(USER_ENCODED))
    want = full_tensors()
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert_bitwise(p, want[name], name)
        st = opt.state[p]
        assert_bitwise(st["exp_avg"], want[f"optim/{name}/exp_avg"], name)
        assert_bitwise(st["exp_avg_sq"], want[f"optim/{name}/exp_avg_sq"], name)
        assert_bitwise(st["step"], torch.tensor(3.0), name)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert all(g["lr"] == 0.0005 and g["betas"] == (0.9, 0.95) for g in opt.param_groups)
    assert sched.state_dict() == treecodec.decode(SCHEDULER) and sched.get_last_lr() == [0.0005, 0.0005]
    assert scaler.state_dict() == SCALER and scaler.get_scale() == 512.0
    assert loader.state == loader_state(0)
    assert random.random() == random.Random(11).random()
    assert np.random.random() == np.random.RandomState(12).random_sample()
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(13)))


def test_sharded_restores_into_one_plain_process() -> None:
    model = build_model(TABLE)
    opt = build_optimizer(model)
    ckpt.restore(str(path_of("sharded")), model=model, optimizer=opt, rng=False)
    want = full_tensors()
    for name, p in model.named_parameters():
        assert_bitwise(p, want[name], name)
        assert_bitwise(opt.state[p]["exp_avg_sq"], want[f"optim/{name}/exp_avg_sq"], name)
    loader = Loader()
    with pytest.warns(UserWarning, match="saved by 2 ranks, restoring on 1"):
        ckpt.restore(str(path_of("sharded")), dataloader=loader, rng=False, strict=False)
    assert loader.state == loader_state(0)


def test_nxd_restores_its_logical_tensors_into_fresh_objects() -> None:
    model = build_model(nxd_names())
    opt = build_optimizer(model)
    ckpt.restore(str(path_of("nxd")), model=model, optimizer=opt, rng=False)
    want = nxd_tensors()
    for name, p in model.named_parameters():
        assert_bitwise(p, want[name], name)
        assert_bitwise(opt.state[p]["exp_avg"], want[f"optim/{name}/exp_avg"], name)


def test_discovery_finds_each_golden() -> None:
    for case in CASES:
        infos = ckpt.list_checkpoints(str(GOLDEN / case))
        assert [(i.step, i.status) for i in infos] == [(3, "committed")], case


# ------------------------------------------------------------------------------------------ the CLI


@pytest.mark.parametrize("case", CASES)
def test_ckpt_verify_passes(case: str) -> None:
    from ckpt.cli.main import cli

    r = CliRunner().invoke(cli, ["verify", str(path_of(case))])
    assert r.exit_code == 0, r.output
    assert "ok" in r.output and "step 3" in r.output


def _convert(src: Path, dst: Path, *args: str) -> CheckpointReader:
    from ckpt.cli.main import cli

    r = CliRunner().invoke(cli, ["convert", str(src), str(dst), *args])
    assert r.exit_code == 0, r.output
    return CheckpointReader(str(dst))


def _assert_full(reader: CheckpointReader) -> None:
    want = full_tensors()
    assert sorted(reader.names()) == sorted(want)
    for name, w in want.items():
        assert_bitwise(reader.read(name), w, name)


def test_convert_single_to_neuron_and_back(tmp_path: Path, config_file: Path) -> None:
    neuron = _convert(
        path_of("single"), tmp_path / "n", "--to", "neuron", "--tp", "2", "--config", str(config_file)
    )
    want = nxd_tensors()
    assert sorted(neuron.names()) == sorted(want)
    for name, w in want.items():
        assert_bitwise(neuron.read(name), w, name)
    _assert_full(_convert(tmp_path / "n", tmp_path / "c", "--to", "cuda"))


def test_convert_nxd_golden_to_cuda_gives_the_full_values(tmp_path: Path) -> None:
    cuda = _convert(path_of("nxd"), tmp_path / "c", "--to", "cuda")  # config from extra.nxd
    _assert_full(cuda)
    assert cuda.manifest.extra["converted_from"]["nxd"] == NXD_EXTRA["nxd"]


def test_convert_sharded_golden_to_hf(tmp_path: Path, config_file: Path) -> None:
    from ckpt.cli.main import cli
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    r = CliRunner().invoke(
        cli,
        [
            "convert",
            str(path_of("sharded")),
            str(out),
            "--to",
            "cuda",
            "--format",
            "hf",
            "--config",
            str(config_file),
        ],
    )
    assert r.exit_code == 0, r.output
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    assert sorted(got) == [n for n, _ in sorted(TABLE)]
    for name, t in got.items():
        assert_bitwise(t, full_tensors()[name], name)
