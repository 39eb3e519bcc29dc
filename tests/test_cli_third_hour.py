"""Issue 37, "nothing silent in the third hour", items 2, 6 and 9, through the ``ckpt`` command as users run it.

2: an HF folder whose ``model.safetensors.index.json`` disagrees with its shards (saved by ``transformers``
``save_pretrained(max_shard_size=...)``, the index then edited as a broken tool would) is refused by every command
that reads it, in one line naming the tensor and the shards, exit 1, nothing written.
6: a checkpoint with one truncated data file is one line in ``verify``, "damaged" in ``ls`` (a stat, no reads),
exit 1 from ``inspect``; the exit-code table is the same in ``ckpt --help``, the README and docs/guide.md.
9: a real accelerate ``save_state`` folder and a real Lightning ``.ckpt`` are named, "not supported yet", exit 2.

Commands run in-process through click's runner (the command group reports errors exactly as the real command
does: ``test_cli_core.test_click_runner_and_the_real_command_report_an_error_the_same_way``), to stay fast.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import ckpt
from tests.cli_helpers import ROOT, tree

pytestmark = pytest.mark.timeout(300)

LM_HEAD = "lm_head.weight"


def cli(*args: object) -> Result:
    from ckpt.cli.main import cli as group

    return CliRunner().invoke(group, [str(a) for a in args])


def one_error(r: Result, *needles: str, code: int) -> str:
    """Exit ``code`` and exactly one ``ckpt: error:`` line on stderr holding every needle."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == code, (r.exit_code, r.output[-3000:])
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------ 2: an HF index that lies


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LlamaForCausalLM saved by transformers in 5 shards; ``lm_head.weight`` alone in the last one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip
    out = tmp_path_factory.mktemp("hf") / "llama"
    LlamaForCausalLM(cfg).save_pretrained(out, max_shard_size=5000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # sharded, as the cases below need
    return out


def _last_shard(index: dict) -> str:
    return index["weight_map"][LM_HEAD]


def _other_shard(index: dict) -> str:
    return next(f for n, f in index["weight_map"].items() if f != _last_shard(index))


def _break(folder: Path, how: str) -> tuple[str, ...]:
    """Edit the folder as a broken tool would; returns what the refusal must name (the tensor and shards)."""
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    wm = index["weight_map"]
    last, other = _last_shard(index), _other_shard(index)
    if how == "moved":  # lm_head mapped to a shard that does not hold it (its own shard then unlisted)
        wm[LM_HEAD] = other
        needles: tuple[str, ...] = (repr(LM_HEAD), other, last)
    elif how == "dropped":  # lm_head left out of the index (a hand-merged index)
        del wm[LM_HEAD]
        needles = (repr(LM_HEAD), last, "not in the index")
    elif how == "phantom":  # a name in the index that no shard holds
        wm["lm_head.bias"] = last
        needles = ("'lm_head.bias'", last, "no shard")
    else:  # "twice": a shard re-saved with lm_head in it too, the index unchanged
        from safetensors.torch import load_file, save_file

        both = load_file(str(folder / other))
        both[LM_HEAD] = load_file(str(folder / last))[LM_HEAD]
        save_file(both, str(folder / other), metadata={"format": "pt"})
        needles = (repr(LM_HEAD), other, last, "2 shards")
    path.write_text(json.dumps(index, indent=2))
    return needles


@pytest.mark.parametrize("how", ["moved", "dropped", "phantom", "twice"])
def test_an_index_that_disagrees_with_its_shards_is_refused_by_every_command(
    tmp_path: Path, llama: Path, how: str
) -> None:
    runs = tmp_path / "runs"
    bad = runs / "llama"
    shutil.copytree(llama, bad)
    needles = _break(bad, how)
    trainer = runs / "checkpoint-3"  # a Trainer folder reads its model the same way
    shutil.copytree(bad, trainer)
    (trainer / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    before = tree(runs)

    for args in (("verify", bad), ("inspect", bad), ("diff", llama, bad), ("diff", bad, llama)):
        one_error(cli(*args), *needles, code=1)
    for fmt in ("ckpt", "hf"):
        dst = tmp_path / f"out_{fmt}"
        one_error(cli("convert", bad, dst, "--to", "cuda", "--format", fmt), *needles, code=1)
        assert not dst.exists()
    listed = cli("ls", runs, "--json")
    assert listed.exit_code == 1, listed.output
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    for name in ("llama", "checkpoint-3"):
        assert rows[name]["status"] == "damaged"
        assert all(n in rows[name]["problems"][0] for n in needles), rows[name]
    assert tree(runs) == before  # the source is never modified


def test_a_folder_as_save_pretrained_wrote_it_reads_and_converts_whole(tmp_path: Path, llama: Path) -> None:
    """The check refuses only disagreement: transformers' own output verifies, converts with every tensor, and
    the conversion diffs equal to it."""
    names = set(json.loads((llama / "model.safetensors.index.json").read_text())["weight_map"])
    ok = cli("verify", llama)
    assert ok.exit_code == 0 and f"{len(names)} tensors readable" in ok.stdout, ok.output
    dst = tmp_path / "conv"
    r = cli("convert", llama, dst, "--to", "cuda")
    assert r.exit_code == 0, r.output
    assert set(ckpt.open_checkpoint(str(dst)).manifest.tensors) == names
    same = cli("diff", llama, dst)
    assert same.exit_code == 0, same.output


def test_merge_lora_reads_a_sharded_base_through_the_same_check(tmp_path: Path) -> None:
    """``--merge-lora`` reads the base's shards itself: a sharded base merges whole, one whose index lies is
    refused before anything is written."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests._lora_models import build, save

    single, adapter = save(build("llama"), tmp_path)
    base = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(base, max_shard_size=40000)
    want = set(load_file(str(single / "model.safetensors")))
    ok = cli("convert", base, tmp_path / "merged", "--to", "cuda", "--format", "hf", "--merge-lora", adapter)
    assert ok.exit_code == 0, ok.output
    got: set[str] = set()
    for f in (tmp_path / "merged").glob("model-*.safetensors"):
        got |= set(load_file(str(f)))
    assert got == want
    needles = _break(base, "moved")
    dst = tmp_path / "merged_bad"
    one_error(cli("convert", base, dst, "--to", "cuda", "--format", "hf", "--merge-lora", adapter), *needles, code=1)
    assert not dst.exists()


# ------------------------------------------------------------------------------ 6: damage said once


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    """Two of our checkpoints of a model with a dozen tensors (model + Adam moments)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 8)).sum().backward()
    opt.step()
    for step in (10, 20):
        ckpt.save(str(tmp_path / f"step_{step:08d}"), step=step, model=m, optimizer=opt)
    return tmp_path


def _data_file(ck: Path) -> Path:
    (f,) = [p for p in ck.iterdir() if p.suffix == ".safetensors"]
    return f


def test_one_truncated_data_file_is_one_line_in_verify_damaged_in_ls_and_exit_1_in_inspect(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = saved / "step_00000020"
    data = _data_file(ck)
    tensors = len(ckpt.open_checkpoint(str(ck)).manifest.tensors)
    assert tensors > 10
    os.truncate(data, data.stat().st_size - 100)

    v = cli("verify", ck)
    assert v.exit_code == 1, v.output
    lines = v.stderr.splitlines()
    assert len(lines) == 1, v.stderr  # one damaged file, one line (was one per tensor, and a count)
    assert data.name in lines[0] and "truncated" in lines[0] and f"holds {tensors} tensors" in lines[0]

    # ls says damaged from a stat of each file: no byte of a data file is read
    from ckpt.storage.local import LocalStorage

    read: list[str] = []
    for method in ("read_bytes", "read_range", "read_into"):
        real = getattr(LocalStorage, method)

        def spy(self, rel, *a, _real=real, **kw):  # noqa: ANN001, ANN002, ANN003
            read.append(rel)
            return _real(self, rel, *a, **kw)

        monkeypatch.setattr(LocalStorage, method, spy)
    listed = cli("ls", saved)
    monkeypatch.undo()
    assert listed.exit_code == 1, listed.output
    assert not [r for r in read if r.endswith(".safetensors")], read
    status = {ln.split()[0]: ln for ln in listed.stdout.splitlines() if ln.strip()[:2] in ("10", "20")}
    assert "committed" in status["10"] and "damaged" in status["20"] and data.name in status["20"]
    rows = {r["step"]: r["status"] for r in json.loads(cli("ls", saved, "--json").stdout)}
    assert rows == {10: "committed", 20: "damaged"}

    i = cli("inspect", ck)
    assert i.exit_code == 1 and "0.weight" in i.stdout, i.output  # what it holds, then the damage
    assert i.stderr.splitlines() == [f"damaged {ck}: {data.name}: {data.stat().st_size} bytes, manifest says "
                                     f"{data.stat().st_size + 100} (truncated or replaced)"]  # fmt: skip
    assert cli("inspect", saved / "step_00000010").exit_code == 0


def test_two_bad_tensors_in_one_file_are_one_line(saved: Path) -> None:
    """Bytes flipped in two tensors of one file (its size intact): one line naming the file and both tensors."""
    ck = saved / "step_00000010"
    data = _data_file(ck)
    man = ckpt.open_checkpoint(str(ck)).manifest
    raw = bytearray(data.read_bytes())
    for name in ("0.weight", "2.bias"):
        raw[man.tensors[name].shards[0].offset + 2] ^= 0x40
    data.write_bytes(bytes(raw))
    v = cli("verify", ck)
    assert v.exit_code == 1
    (line,) = v.stderr.splitlines()
    assert data.name in line and "'0.weight'" in line and "'2.bias'" in line and "checksum" in line, line
    assert cli("ls", saved).exit_code == 0  # same sizes: only verify, which reads, can tell


def _table(text: str) -> list[tuple[str, str]]:
    """(code, meaning) rows of the exit-code table as ``ckpt --help`` prints it."""
    return re.findall(r"^\s*(\d+)\s{2,}(\S.*?)\s*$", text, re.M)


def test_the_exit_code_table_is_the_same_in_help_readme_and_guide() -> None:
    from ckpt.cli.common import EXIT_TABLE

    from ckpt.errors import CkptError, CorruptionError

    rows = _table(EXIT_TABLE)
    assert [c for c, _ in rows] == ["0", "1", "2", "130"]
    assert (CkptError.exit_code, CorruptionError.exit_code) == (2, 1)
    shown = cli("--help").stdout
    for code, meaning in rows:
        assert re.search(rf"^\s*{code}\s+{re.escape(meaning)}$", shown, re.M), (code, shown)
    for doc in ("README.md", "docs/guide.md"):
        text = (ROOT / doc).read_text()
        for code, meaning in rows:
            assert f"| {code} | {meaning} |" in text, (doc, code, meaning)


# ------------------------------------------------------------------------------ 9: other tools' checkpoints

_MAKE = textwrap.dedent(
    """
    import sys, torch
    from accelerate import Accelerator
    out = sys.argv[1]
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = acc.prepare(m, opt)
    acc.backward(m(torch.randn(3, 4)).sum())
    opt.step()
    acc.save_state(out + "/accelerate_state")

    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def training_step(self, batch, i):
            return self.lin(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=2)
    trainer = L.Trainer(max_steps=2, enable_progress_bar=False, logger=False, enable_model_summary=False,
                        accelerator="cpu", default_root_dir=out + "/lightning")
    trainer.fit(Tiny(), data)
    """
)


@pytest.fixture(scope="module")
def others(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ``Accelerator.save_state`` folder and a real Lightning ``Trainer`` checkpoint (2 steps, CPU)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("others")
    env = {**os.environ, "USE_TORCH_XLA": "0", "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _MAKE, str(out)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "accelerate_state" / "random_states_0.pkl").is_file()
    assert [p.name for p in (out / "lightning" / "checkpoints").glob("*.ckpt")] == ["epoch=0-step=2.ckpt"]
    return out


def test_other_tools_checkpoints_are_read_by_every_command(tmp_path: Path, others: Path) -> None:
    """Both used to be "no checkpoints" (exit 0) or "manifest.json missing"; both are read now
    (tests/test_accelerate.py, tests/test_lightning_files.py), listed beside each other, sources untouched."""
    acc = others / "accelerate_state"
    light = others / "lightning" / "checkpoints" / "epoch=0-step=2.ckpt"
    before = tree(others)
    for path in (acc, light):
        for args in (("inspect", path), ("verify", path), ("diff", path, path)):
            result = cli(*args)
            assert result.exit_code == 0, (args, result.output)
            assert "not supported" not in result.output
    listed = cli("ls", others)
    assert listed.exit_code == 0, listed.output
    assert "not supported yet" not in listed.output
    assert "epoch=0-step=2.ckpt" in listed.stdout and "accelerate_state" in listed.stdout
    rows = json.loads(cli("ls", others, "--json").stdout)
    assert sorted((r["format"], r["status"]) for r in rows) == [("accelerate", "ok"), ("lightning", "ok")]
    assert tree(others) == before
