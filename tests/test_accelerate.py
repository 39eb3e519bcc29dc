"""accelerate ``save_state`` folders in every command, converted both ways, and ``CkptStateHooks``, with real
accelerate at its defaults (``USE_TORCH_XLA=0``: torch-xla must not take the device).

The training run (``tests/_accelerate_train.py``) is a fresh process each time: an MLP with dropout, AdamW,
StepLR, a ``StatefulDataLoader`` (``use_stateful_dataloader=True``) and a registered custom object.  Its loader has
its own ``generator=``: a DataLoader otherwise draws its base seed from torch's global RNG at every ``iter()``,
and a resumed run makes one more iterator than the uninterrupted one, so not even accelerate's own folder would
resume bit-exactly (the dropout masks would differ).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cli_helpers import tree

# not imported here: torch-xla would take the device from accelerate, and USE_TORCH_XLA=0 is set only in the
# processes that run it (the rest of the suite's in-process XLA tests read the same variable through transformers)
for _needed in ("accelerate", "torchdata"):
    if importlib.util.find_spec(_needed) is None:
        pytest.skip(f"needs {_needed}", allow_module_level=True)

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "_accelerate_train.py"
STEPS = 8


def ckpt_cli(*args: object) -> Result:
    """The ``ckpt`` command, in this process (a fresh one per call costs seconds of imports)."""
    from ckpt.cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_one_error(r: Result, *needles: str, code: int) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("ckpt: warning")]
    assert r.exit_code == code, (r.exit_code, r.output[-3000:])
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _run(**args: object) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "USE_TORCH_XLA": "0",
        "PJRT_DEVICE": "CPU",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    return subprocess.run([sys.executable, str(TRAIN), json.dumps(args)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def _losses(out: Path) -> dict[int, str]:
    sys.path.insert(0, str(HERE))
    from _accelerate_train import read_losses

    return read_losses(str(out))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of STEPS steps that saved at step 4 (``checkpoints/checkpoint_0``)."""
    out = tmp_path_factory.mktemp("acc") / "run"
    r = _run(out=str(out), steps=STEPS, save_at=[4])
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_save_state_folder_through_ckpt_and_back_resumes_bit_exact(run: Path, tmp_path: Path) -> None:
    src = run / "checkpoints" / "checkpoint_0"
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "dl_state_dict.bin", "random_states_0.pkl",
            "custom_checkpoint_0.pkl"} <= set(os.listdir(src))  # fmt: skip
    before = tree(src)
    ours, back = tmp_path / "ours", tmp_path / "back"
    r = ckpt_cli("convert", src, ours, "--to", "cuda", "--format", "ckpt", "--step", "4")
    assert r.exit_code == 0, r.output
    r = ckpt_cli("convert", ours, back, "--to", "cuda", "--format", "accelerate")
    assert r.exit_code == 0, r.output
    assert "not written" not in r.output
    assert tree(src) == before  # the source is never touched
    # every file accelerate wrote comes back with the same content
    for name in (
        "optimizer.bin",
        "scheduler.bin",
        "dl_state_dict.bin",
        "random_states_0.pkl",
        "custom_checkpoint_0.pkl",
    ):
        a, b = (torch.load(p / name, weights_only=False) for p in (src, back))
        assert repr(a) == repr(b), name
    assert (src / "model.safetensors").read_bytes() == (back / "model.safetensors").read_bytes()
    d = ckpt_cli("diff", src, back, "--json")
    assert d.exit_code == 0, d.output

    # load_state on the converted folder, in a fresh process, continues the uninterrupted run exactly
    resumed = tmp_path / "resumed"
    r = _run(out=str(resumed), steps=STEPS, save_at=[], resume=str(back), start=1)
    assert r.returncode == 0, r.stderr[-3000:]
    full, cont = _losses(run), _losses(resumed)
    assert sorted(cont) == list(range(5, STEPS + 1))
    assert {s: full[s] for s in cont} == cont


def test_a_ckpt_checkpoint_of_a_plain_loop_resumes_under_accelerate(run: Path, tmp_path: Path) -> None:
    """The other way in: the same run in a plain torch loop, saved by ``CheckpointManager`` at step 4, converted to
    a save_state folder: accelerate's ``load_state`` continues it as the accelerate run continued its own."""
    plain = tmp_path / "plain"
    r = _run(plain=True, out=str(plain), steps=4, save_at=4)
    assert r.returncode == 0, r.stderr[-3000:]
    full = _losses(run)
    assert _losses(plain) == {s: full[s] for s in range(1, 5)}  # the same run so far, without accelerate
    folder = tmp_path / "acc"
    c = ckpt_cli(
        "convert", plain / "ckpt" / "step_00000004", folder, "--to", "cuda", "--format", "accelerate"
    )
    assert c.exit_code == 0, c.output
    assert {
        "model.safetensors",
        "optimizer.bin",
        "scheduler.bin",
        "dl_state_dict.bin",
        "random_states_0.pkl",
    } == set(os.listdir(folder))
    resumed = tmp_path / "resumed"
    r = _run(out=str(resumed), steps=STEPS, save_at=[], resume=str(folder), counter_state=False, at=4)
    assert r.returncode == 0, r.stderr[-3000:]
    cont = _losses(resumed)
    assert sorted(cont) == list(range(5, STEPS + 1)) and cont == {s: full[s] for s in cont}


def test_ls_inspect_verify_find_accelerate_beside_ours(run: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "acc").mkdir(parents=True)
    for f in (run / "checkpoints" / "checkpoint_0").iterdir():
        (root / "acc" / f.name).write_bytes(f.read_bytes())
    assert ckpt_cli("convert", root / "acc", root / "step_00000004", "--to", "cuda", "--format", "ckpt",
                    "--step", "4").exit_code == 0  # fmt: skip
    rows = json.loads(ckpt_cli("ls", root, "--json").stdout)
    assert sorted((r["format"], r["name"], r["status"]) for r in rows) == [
        ("accelerate", "acc", "ok"), ("ckpt", "step_00000004", "committed")]  # fmt: skip
    acc_row = next(r for r in rows if r["format"] == "accelerate")
    assert acc_row["tensors"] == 12 and acc_row["step"] is None  # 4 parameters + 2 AdamW moments each
    shown = ckpt_cli("inspect", root / "acc")
    assert shown.exit_code == 0 and "optim/0.weight/exp_avg" in shown.stdout and "accelerate" in shown.stdout
    assert ckpt_cli("verify", root / "acc").exit_code == 0
    (root / "acc" / "model.safetensors").write_bytes((root / "acc" / "model.safetensors").read_bytes()[:-8])
    r = ckpt_cli("verify", root / "acc")
    assert_one_error(r, "model.safetensors", "truncated", code=1)


def _stepped_folder(folder: Path, m: torch.nn.Module) -> Path:
    """A save_state folder of ``m`` after one AdamW step, written as save_state writes it."""
    from safetensors.torch import save_file

    folder.mkdir()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    save_file(m.state_dict(), folder / "model.safetensors")
    torch.save(opt.state_dict(), folder / "optimizer.bin")
    torch.save({"step": 0, "random_state": (3, tuple(range(625)), None)}, folder / "random_states_0.pkl")
    return folder


def test_optimizer_numbers_that_nothing_names_are_refused(tmp_path: Path) -> None:
    """Two parameters with one shape: the moments' shapes cannot say which is which; the refusal names the fix."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))
    folder = _stepped_folder(tmp_path / "acc", m)
    r = ckpt_cli("convert", folder, tmp_path / "out", "--to", "cuda", "--format", "ckpt")
    assert_one_error(r, "optimizer.bin", "shape [3, 3]", "--config", code=2)
    assert not (tmp_path / "out").exists()


def test_a_config_whose_model_type_transformers_does_not_know_is_one_layout_error(tmp_path: Path) -> None:
    """--config names the optimizer's numbers by rebuilding the model; a model_type transformers cannot build is
    refused in one line naming it (exit 2), not a traceback, and nothing is written."""
    folder = _stepped_folder(tmp_path / "acc", torch.nn.Linear(3, 2))
    for model_type in ("no-such-model", "vit"):  # unknown to transformers; known, but no causal LM
        cfg = tmp_path / f"{model_type}.json"
        cfg.write_text(json.dumps({"model_type": model_type}))
        r = ckpt_cli("convert", folder, tmp_path / "out", "--to", "cuda", "--format", "ckpt", "--config", cfg)
        assert_one_error(r, "optimizer.bin", f"model_type {model_type!r}", "cannot rebuild the parameter order",
                         code=2)  # fmt: skip
        assert r.exception is None or isinstance(r.exception, SystemExit)
        assert not (tmp_path / "out").exists()


class Evil:
    def __reduce__(self) -> tuple:
        return (os.system, ("true",))


def test_pickled_globals_outside_the_allow_list_are_refused_by_name(run: Path, tmp_path: Path) -> None:
    folder = tmp_path / "acc"
    folder.mkdir()
    for f in (run / "checkpoints" / "checkpoint_0").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    torch.save({"step": 0, "random_state": Evil()}, folder / "random_states_0.pkl")
    for args in (
        ("inspect", folder),
        ("convert", folder, tmp_path / "out", "--to", "cuda", "--format", "ckpt"),
    ):
        r = ckpt_cli(*args)
        line = assert_one_error(r, "random_states_0.pkl", "system", code=2)
        assert "nothing was executed" in line, line
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ CkptStateHooks


def test_hooks_save_through_ckpt_survive_sigkill_and_resume_bit_exact(run: Path, tmp_path: Path) -> None:
    from ckpt.integrations.accelerate import POINTER, latest_complete

    out = tmp_path / "hooked"
    # the node-local tier takes every save, the root every other one
    tiers = {"local_dir": str(out / "local"), "local_every": 2, "persist_every": 4}
    r = _run(
        out=str(out),
        steps=STEPS,
        save_at=[2, 4, 6],
        hooks=str(out / "ckpt"),
        kill_after=6,
        hook_options=tiers,
    )
    assert r.returncode == -9, r.stderr[-3000:]  # SIGKILLed right after the save of step 6 returned
    full = _losses(run)
    assert _losses(out) == {s: full[s] for s in range(1, 7)}  # the hooks change nothing in training
    folders = sorted(os.listdir(out / "checkpoints"))
    assert folders == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    for f in folders:  # accelerate wrote no model file: the model is a step of ours
        names = set(os.listdir(out / "checkpoints" / f))
        assert POINTER in names and "model.safetensors" not in names and "optimizer.bin" in names, names
    r = ckpt_cli("convert", out / "checkpoints", tmp_path / "x", "--to", "cuda")  # one level too high: named
    assert_one_error(r, "holds 3 accelerate save_state folders", "checkpoint_2", code=2)
    latest = latest_complete(str(out / "checkpoints"))
    assert latest is not None
    step = json.loads((Path(latest) / POINTER).read_text())["step"]
    assert step in (4, 6)  # step 6's write may have been cut by the kill; never an incomplete one

    rows = json.loads(ckpt_cli("ls", out, "--json").stdout)
    ours = {
        (r["name"].split("/")[0], r["step"])
        for r in rows
        if r["format"] == "ckpt" and r["status"] == "committed"
    }
    assert ("ckpt", 4) in ours and ("local", step) in ours  # the root has step 4; the local tier the newest
    shown = ckpt_cli(
        "inspect", latest
    )  # the folder read whole: model from the step, optimizer from accelerate
    assert shown.exit_code == 0 and "optim/0.weight/exp_avg" in shown.stdout and "3.weight" in shown.stdout

    resumed = tmp_path / "resumed"
    index = int(Path(latest).name.rsplit("_", 1)[1])
    r = _run(
        out=str(resumed),
        steps=STEPS,
        save_at=[8],
        resume=latest,
        hooks=str(out / "ckpt"),
        start=index + 1,
        hook_options=tiers,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    cont = _losses(resumed)
    assert sorted(cont) == list(range(step + 1, STEPS + 1))
    assert cont == {s: full[s] for s in cont}

    # the same folder once its model's step is gone from every tier: load_state refuses it, naming why
    for manifest in out.glob(f"**/step_{step:08d}/manifest.json"):
        manifest.unlink()
    r = _run(out=str(tmp_path / "again"), steps=STEPS, save_at=[], resume=latest, hooks=str(out / "ckpt"),
             start=index + 2, hook_options=tiers)  # fmt: skip
    assert r.returncode != 0 and "cannot resume from it" in r.stderr and f"step {step}" in r.stderr, r.stderr[
        -2000:
    ]


def test_hooks_refuse_a_folder_that_is_not_complete(run: Path, tmp_path: Path) -> None:
    from ckpt.integrations.accelerate import POINTER, latest_complete, problems

    base = tmp_path / "checkpoints"
    good = base / "checkpoint_0"
    good.mkdir(parents=True)
    for f in (run / "checkpoints" / "checkpoint_0").iterdir():
        (good / f.name).write_bytes(f.read_bytes())
    assert problems(str(good)) == []
    torn = base / "checkpoint_1"
    torn.mkdir()
    for f in good.iterdir():
        (torn / f.name).write_bytes(f.read_bytes())
    (torn / "random_states_0.pkl").write_bytes((good / "random_states_0.pkl").read_bytes()[:-30])
    assert problems(str(torn)) == ["random_states_0.pkl is torn (not a complete torch.save file)"]
    pointed = base / "checkpoint_2"
    pointed.mkdir()
    for f in good.iterdir():
        if f.name != "model.safetensors":
            (pointed / f.name).write_bytes(f.read_bytes())
    (pointed / POINTER).write_text(json.dumps({"root": str(tmp_path / "ckpt"), "step": 9}))
    (bad,) = problems(str(pointed))
    assert "step 9" in bad and "interrupted" in bad
    assert latest_complete(str(base)) == str(good)  # the newest folder that resumes exactly


# ------------------------------------------------------------------------------ two processes (DDP on gloo)


def _ddp_rank(rank: int, world: int, kwargs: dict) -> list[tuple[int, str]]:
    os.environ["USE_TORCH_XLA"] = "0"
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    sys.path.insert(0, str(HERE))
    from _accelerate_train import train

    return train(**kwargs, cpu=True)


def test_two_processes_hooks_save_and_converted_folder_resumes_bit_exact(tmp_path: Path) -> None:
    """DDP on 2 gloo ranks: the hooks save the model collectively; the folder (model from our step, the rest from
    accelerate's files, one random_states per process) converts to a plain save_state folder whose load_state
    continues both ranks exactly."""
    from tests.conftest import run_ranks

    out = tmp_path / "ddp"
    full = run_ranks(_ddp_rank, 2, {"out": str(out), "steps": 6, "save_at": [3], "hooks": str(out / "ckpt")})
    folder = out / "checkpoints" / "checkpoint_0"
    assert {"random_states_0.pkl", "random_states_1.pkl", "ckpt_step.json"} <= set(os.listdir(folder))
    back = tmp_path / "back"
    r = ckpt_cli("convert", folder, back, "--to", "cuda", "--format", "accelerate")
    assert r.exit_code == 0, r.output
    for name in ("random_states_0.pkl", "random_states_1.pkl", "optimizer.bin"):
        a, b = (torch.load(p / name, weights_only=False) for p in (folder, back))
        assert repr(a) == repr(b), name
    resumed = run_ranks(
        _ddp_rank,
        2,
        {"out": str(tmp_path / "resumed"), "steps": 6, "save_at": [], "resume": str(back), "start": 1},
    )
    for rank in range(2):
        assert resumed[rank] == full[rank][3:], rank
        assert full[0][3:] != full[1][3:]  # each rank trains on its own shard of the data


_LLAMA = """
import sys, torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
acc = Accelerator()
model, opt = acc.prepare(model, opt)
ids = torch.randint(0, 32, (2, 8))
acc.backward(model(input_ids=ids, labels=ids).loss)
opt.step()
acc.save_state(sys.argv[1] + "/state")
cfg.to_json_file(sys.argv[1] + "/config.json")
"""


def test_hf_model_folder_to_nxd_and_back_names_the_optimizer_from_config(tmp_path: Path) -> None:
    """A Llama's layers share shapes: its optimizer numbers are named from --config (refused without), and the
    folder goes to an NxD TP=2 tag and back to accelerate with every tensor and param_group as it was."""
    env = {
        **os.environ,
        "USE_TORCH_XLA": "0",
        "PJRT_DEVICE": "CPU",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    p = subprocess.run(
        [sys.executable, "-c", _LLAMA, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    state, cfg = tmp_path / "state", tmp_path / "config.json"
    r = ckpt_cli("convert", state, tmp_path / "dcp", "--to", "cuda", "--format", "dcp")
    assert_one_error(r, "optimizer.bin", "--config", code=2)
    r = ckpt_cli(
        "convert", state, tmp_path / "tag", "--to", "neuron", "--tp", "2", "--format", "nxd", "--config", cfg
    )
    assert r.exit_code == 0, r.output
    r = ckpt_cli(
        "convert",
        tmp_path / "tag",
        tmp_path / "back",
        "--to",
        "cuda",
        "--format",
        "accelerate",
        "--config",
        cfg,
    )
    assert r.exit_code == 0, r.output
    d = ckpt_cli("diff", state, tmp_path / "back", "--config", cfg, "--json")
    assert d.exit_code == 0, d.output
    a, b = (torch.load(f / "optimizer.bin", weights_only=False) for f in (state, tmp_path / "back"))
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    # the config saved beside the state (model.config.save_pretrained(output_dir)): still the accelerate folder,
    # whose config names the optimizer's numbers
    (state / "config.json").write_bytes(cfg.read_bytes())
    rows = json.loads(ckpt_cli("ls", tmp_path, "--json").stdout)
    assert ("accelerate", "state", "ok") in {(r["format"], r.get("name"), r["status"]) for r in rows}
    r = ckpt_cli("convert", state, tmp_path / "dcp", "--to", "cuda", "--format", "dcp")
    assert r.exit_code == 0 and "optimizer" not in r.stderr, r.output
    r = ckpt_cli("convert", state, tmp_path / "hf", "--to", "cuda", "--format", "hf")
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    ours, theirs = load_file(state / "model.safetensors"), {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        theirs.update(load_file(f))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


# ------------------------------------------------------------------------------ naming rules, two models


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_optimizer_numbers_are_named_by_unique_shapes_and_refused_otherwise(data: st.DataObject) -> None:
    """Whatever order the optimizer holds the parameters in, unique moment shapes name each number right; one shape
    shared by two parameters is refused (never a guess)."""
    from ckpt.converters.accelerate_files import name_optimizer_params

    from ckpt.errors import LayoutError

    n = data.draw(st.integers(1, 6))
    shapes = data.draw(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4)), min_size=n, max_size=n))
    names = [f"layer{i}.weight" for i in range(n)]
    order = data.draw(st.permutations(range(n)))  # the optimizer's numbering of the model's tensors
    stateless = data.draw(st.sets(st.sampled_from(range(n)), max_size=1))
    state = {k: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(shapes[i])} for k, i in enumerate(order)
             if k not in stateless}  # fmt: skip
    opt = {"state": state, "param_groups": [{"lr": 0.1, "params": list(range(n))}]}
    model = {name: tuple(s) for name, s in zip(names, shapes, strict=True)}
    if len(set(shapes)) == len(shapes):
        assert name_optimizer_params(Path("optimizer.bin"), opt, model, None) == {
            k: names[i] for k, i in enumerate(order)
        }
    else:
        with pytest.raises(LayoutError, match="--config"):
            name_optimizer_params(Path("optimizer.bin"), opt, model, None)


def test_two_models_convert_to_ckpt_and_back(tmp_path: Path) -> None:
    """``model_1.safetensors`` (a second prepared model) travels as ``model_1.<name>`` tensors and comes back, with
    the ``GradScaler`` state and the RNG."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "acc"
    src.mkdir()
    save_file({"w": torch.arange(6.0).reshape(2, 3)}, src / "model.safetensors")
    save_file({"w": torch.ones(4), "b": torch.zeros(1)}, src / "model_1.safetensors")
    seed = torch.Generator().manual_seed(7).get_state()
    torch.save({"step": 3, "random_state": (3, tuple(range(625)), None), "torch_manual_seed": seed},
               src / "random_states_0.pkl")  # fmt: skip
    scaler = {
        "scale": 32768.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 7,
    }
    torch.save(scaler, src / "scaler.pt")  # GradScaler.state_dict(), as save_state writes it
    assert ckpt_cli("convert", src, tmp_path / "ours", "--to", "cuda", "--format", "ckpt").exit_code == 0
    shown = ckpt_cli("inspect", tmp_path / "ours", "--json")
    assert sorted(json.loads(shown.stdout)["tensors"]) == ["model_1.b", "model_1.w", "w"]
    r = ckpt_cli("convert", tmp_path / "ours", tmp_path / "back", "--to", "cuda", "--format", "accelerate")
    assert r.exit_code == 0, r.output
    for name in ("model.safetensors", "model_1.safetensors"):
        a, b = load_file(src / name), load_file(tmp_path / "back" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert torch.load(tmp_path / "back" / "scaler.pt", weights_only=True) == scaler
    rs = torch.load(tmp_path / "back" / "random_states_0.pkl", weights_only=False)
    assert rs["step"] == 3 and torch.equal(rs["torch_manual_seed"], seed)
    assert rs["random_state"] == (
        3,
        tuple(range(625)),
        None,
    )  # tuples stay tuples: random.setstate takes them
