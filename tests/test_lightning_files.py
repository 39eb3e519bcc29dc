"""Lightning's own files in every command: a ``.ckpt`` written by Lightning at its defaults is listed, inspected,
verified, diffed and converted; a pickled global outside the allow-list is refused by name; ``verify-resume``
reads a resumed run's CSVLogger and TensorBoardLogger folders (one ``version_<N>`` per session)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

os.environ.setdefault("USE_TORCH_XLA", "0")
pytest.importorskip("lightning")

sys.path.insert(0, str(Path(__file__).parent))
import _lightning_run as run  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from ckpt.cli.main import cli as group  # noqa: E402
from ckpt.converters.lightning import load_ckpt_file  # noqa: E402
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: E402

from ckpt.integrations.lightning import CkptCheckpointIO  # noqa: E402


def cli(*args: object) -> tuple[int, str]:
    r = CliRunner().invoke(group, [str(a) for a in args])
    return r.exit_code, r.output


class Unlisted:
    """Not on any allow-list: a .ckpt pickling it must be refused, naming it."""


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file ModelCheckpoint writes with Lightning's defaults (no plugin): lightning_logs/.../epoch=0-step=4.ckpt."""
    root = tmp_path_factory.mktemp("lt")
    pl.seed_everything(0)
    trainer = pl.Trainer(default_root_dir=root, max_steps=4, accelerator="cpu", devices=1, enable_progress_bar=False)
    trainer.fit(run.Tiny(), run.data())
    (found,) = root.rglob("*.ckpt")
    return found


def test_ls_inspect_verify_read_a_lightning_ckpt(lightning_ckpt: Path) -> None:
    root = lightning_ckpt.parents[3]
    code, out = cli("ls", root, "--json")
    assert code == 0, out
    assert '"format": "lightning"' in out and '"step": 4' in out and lightning_ckpt.name in out
    code, out = cli("inspect", lightning_ckpt)
    assert code == 0 and "Lightning file  step 4" in out and "net.0.weight" in out, out
    assert "optim/0.0/exp_avg" in out  # AdamW's moments, by Lightning's parameter number
    code, out = cli("verify", lightning_ckpt)
    assert code == 0 and out.startswith("ok "), out


def test_convert_to_ours_and_dcp_and_back_into_lightning_exactly(lightning_ckpt: Path, tmp_path: Path) -> None:
    code, out = cli("convert", lightning_ckpt, tmp_path / "ours", "--to", "cuda")
    assert code == 0, out
    code, out = cli("diff", lightning_ckpt, tmp_path / "ours")
    assert code == 0 and "13 equal, 0 changed" in out, out
    # what the plugin loads from the converted folder is Lightning's dict, exactly: resumable with ckpt_path=
    from test_lightning_plugin import same

    same(CkptCheckpointIO().load_checkpoint(tmp_path / "ours"), load_ckpt_file(lightning_ckpt))
    code, out = cli("convert", lightning_ckpt, tmp_path / "dcp", "--to", "cuda", "--format", "dcp")
    assert code == 0 and (tmp_path / "dcp" / ".metadata").is_file(), out
    pl.seed_everything(0)
    model = run.Tiny()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=6, accelerator="cpu", devices=1,
                         enable_progress_bar=False, plugins=[CkptCheckpointIO()], logger=False)  # fmt: skip
    trainer.fit(model, run.data(), ckpt_path=str(tmp_path / "ours"))
    assert trainer.global_step == 6 and model.losses[0][0] == 4


def test_convert_format_lightning_writes_a_ckpt_lightning_loads(lightning_ckpt: Path, tmp_path: Path) -> None:
    from test_lightning_plugin import same

    assert cli("convert", lightning_ckpt, tmp_path / "ours", "--to", "cuda")[0] == 0
    code, out = cli("convert", tmp_path / "ours", tmp_path / "back.ckpt", "--to", "cuda", "--format", "lightning")
    assert code == 0, out
    same(load_ckpt_file(tmp_path / "back.ckpt"), load_ckpt_file(lightning_ckpt))  # Lightning's dict, exactly
    # from a source Lightning did not write (DCP): the weights, which load_from_checkpoint takes
    assert cli("convert", lightning_ckpt, tmp_path / "dcp", "--to", "cuda", "--format", "dcp")[0] == 0
    code, out = cli("convert", tmp_path / "dcp", tmp_path / "w.ckpt", "--to", "cuda", "--format", "lightning")
    assert code == 0 and "optimizer-state" in out, out  # said to be left out
    model = run.Tiny.load_from_checkpoint(tmp_path / "w.ckpt")
    want = load_ckpt_file(lightning_ckpt)["state_dict"]
    same(dict(model.state_dict()), dict(want))
    code, out = cli("convert", tmp_path / "dcp", tmp_path / "w.ckpt", "--to", "cuda", "--format", "lightning")
    assert code != 0 and "existing file" in out and "\n" not in out.strip()  # never overwritten


def test_a_pickled_global_outside_the_allow_list_is_refused_by_name(tmp_path: Path) -> None:
    bad = tmp_path / "bad.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": {"w": torch.ones(2)},
                "hyper_parameters": {"obj": Unlisted()}}, bad)  # fmt: skip
    for command in ("inspect", "verify"):
        code, out = cli(command, bad)
        assert code != 0 and "Unlisted" in out and "\n" not in out.strip(), out
    code, out = cli("convert", bad, tmp_path / "out", "--to", "cuda")
    assert code != 0 and "Unlisted" in out and not (tmp_path / "out").exists(), out


@pytest.mark.parametrize("logger", ["csv", "tensorboard"])
def test_verify_resume_reads_a_resumed_runs_lightning_logs(tmp_path: Path, logger: str) -> None:
    def fit(steps: int, resume: str | None) -> None:
        pl.seed_everything(0, workers=True)
        log = CSVLogger(tmp_path) if logger == "csv" else TensorBoardLogger(tmp_path)
        run.trainer(tmp_path, steps, CkptCheckpointIO(), logger=log, deterministic=True).fit(
            run.Tiny(), run.data(), ckpt_path=resume
        )

    fit(5, None)  # the first session logs step 4 after the checkpoint of step 4: the overlap
    fit(8, str(tmp_path / "ckpts" / "epoch=0-step=4.ckpt"))
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0", "version_1"]
    code, out = cli("verify-resume", tmp_path)
    assert code == 0, out
    assert "2 sessions" in out and "CONTINUOUS at 1 boundary" in out, out


def test_hf_model_inside_a_lightning_module_converts_to_hf_with_config(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import json

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    (tmp_path / "config.json").write_text(cfg.to_json_string())

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.LlamaForCausalLM(cfg)

        def training_step(self, batch: list[torch.Tensor], i: int) -> torch.Tensor:
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    pl.Trainer(default_root_dir=tmp_path, max_steps=2, accelerator="cpu", enable_progress_bar=False,
               logger=False).fit(LM(), loader)  # fmt: skip
    (src,) = tmp_path.rglob("*.ckpt")
    code, out = cli("convert", src, tmp_path / "hf", "--to", "cuda", "--format", "hf", "--config",
                    tmp_path / "config.json")  # fmt: skip
    assert code == 0, out
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    want = {n.removeprefix("model."): t for n, t in load_ckpt_file(src)["state_dict"].items()}
    got = hf.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    # the module's prefix is recorded: converted with --config to ours and back, Lightning's names come back
    assert cli("convert", src, tmp_path / "ours", "--to", "cuda", "--config", tmp_path / "config.json")[0] == 0
    assert json.loads((tmp_path / "ours" / "manifest.json").read_text())["extra"]["lightning"]["prefix"] == "model."
    code, out = cli("convert", tmp_path / "ours", tmp_path / "back.ckpt", "--to", "cuda", "--format", "lightning")
    assert code == 0, out
    from test_lightning_plugin import same

    same(load_ckpt_file(tmp_path / "back.ckpt"), load_ckpt_file(src))
    # a layout change needs the optimizer's parameters by name, which Lightning's file does not give: refused
    code, out = cli("convert", src, tmp_path / "nxd", "--to", "neuron", "--format", "nxd", "--tp", "2",
                    "--config", tmp_path / "config.json")  # fmt: skip
    assert code != 0 and "Lightning numbers the parameters" in out and not (tmp_path / "nxd").exists(), out


def test_lightning_fsdp_sharded_folder_is_read_and_a_deepspeed_folder_is_read_or_refused(lightning_ckpt: Path, tmp_path: Path) -> None:
    """The sharded folder as Lightning's FSDPStrategy lays it out, written by Lightning's own DCP save helper (its
    FSDPStrategy itself refuses accelerator="cpu"): {"model", "optimizer_0"} in DCP, the rest in meta.pt."""
    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    pl.seed_everything(0)
    model = run.Tiny()
    opt = torch.optim.AdamW(model.parameters())
    model.net(torch.ones(2, 4)).sum().backward()
    opt.step()
    folder = tmp_path / "epoch=0-step=4.ckpt"
    state = {"model": model.state_dict(), "optimizer_0": get_optimizer_state_dict(model, opt)}
    _distributed_checkpoint_save(state, folder)
    meta = {k: v for k, v in load_ckpt_file(lightning_ckpt).items() if k not in ("state_dict", "optimizer_states")}
    torch.save(meta, folder / "meta.pt")
    code, out = cli("inspect", folder)
    assert code == 0 and "Lightning FSDP sharded folder  step 4" in out and "optim/net.0.weight/exp_avg" in out, out
    assert cli("verify", folder)[0] == 0
    code, out = cli("convert", folder, tmp_path / "ours", "--to", "cuda")
    assert code == 0, out
    code, out = cli("diff", folder, tmp_path / "ours")
    assert code == 0 and "0 changed" in out, out

    # DeepSpeed's folders are read (tests/test_lightning_deepspeed.py: every stage, against DeepSpeed's own reading);
    # one that is not a ZeRO save is refused in one line, nothing written
    real = next((Path(__file__).parents[1] / "fixtures" / "lightning_deepspeed" / "mlp_zero3").glob("*.ckpt"))
    code, out = cli("inspect", real)
    assert code == 0 and "Lightning DeepSpeed ZeRO-3 (1 rank) folder  step 3" in out, out
    ds = tmp_path / "ds.ckpt"
    (ds / "checkpoint").mkdir(parents=True)
    torch.save({"module": {}}, ds / "checkpoint" / "mp_rank_00_model_states.pt")
    (ds / "latest").write_text("checkpoint")
    for command in ("inspect", "verify"):
        code, out = cli(command, ds)
        assert code != 0 and "not a DeepSpeed ZeRO checkpoint file (no param_shapes)" in out, out
    code, out = cli("convert", ds, tmp_path / "x", "--to", "cuda")
    assert code != 0 and "DeepSpeed" in out and not (tmp_path / "x").exists(), out
