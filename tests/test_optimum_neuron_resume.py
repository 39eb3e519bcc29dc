"""A run moved Trainer -> optimum-neuron ``checkpoint-N`` -> Trainer resumes with the uninterrupted run's losses.

The runs are ``examples/hf_trainer.py`` (a real ``transformers.Trainer`` on CPU, ``USE_TORCH_XLA=0``), shared with
``test_integration_transformers.py``: ``straight`` (20 steps) and ``crashed`` (killed after step 12, newest
``checkpoint-10``).  ``checkpoint-10`` is written as the folder a NeuronTrainer run keeps (TP=2, tag ``shards/``,
the Trainer files at the root), and that folder, the Trainium side, converts back to a Trainer folder that
``Trainer.train(resume_from_checkpoint=...)`` continues from, bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from cli_helpers import ckpt_cli
from test_integration_transformers import STEPS, crashed, losses, straight, train  # noqa: F401 (fixtures)


def convert(*args: object) -> None:
    r = ckpt_cli("convert", *args)
    assert r.returncode == 0, r.stderr[-3000:]


def test_trainer_run_through_an_optimum_neuron_folder_resumes_exactly(
    crashed: Path,  # noqa: F811
    straight: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    trn = tmp_path / "trn" / "checkpoint-10"
    convert(crashed / "checkpoint-10", trn, "--to", "neuron", "--format", "optimum-neuron", "--tp", "2")
    assert (trn / "shards" / "done").is_file() and (trn / "shards" / "model").is_dir()
    assert (trn / "shards" / "optim").is_dir()  # the optimizer state rides in the tag, as NxD saves it
    assert json.loads((trn / "trainer_state.json").read_text())["global_step"] == 10
    assert (trn / "scheduler.pt").is_file() and (trn / "rng_state_0.pth").is_file()
    back = tmp_path / "checkpoint-10"
    convert(trn, back, "--to", "cuda", "--format", "hf-trainer")
    a = torch.load(crashed / "checkpoint-10" / "optimizer.pt")
    b = torch.load(back / "optimizer.pt")
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    out = tmp_path / "out"
    shutil.copytree(crashed, out)
    assert train(out, "--resume", back) == 0
    want = losses(straight)
    got = {s: v for s, v in losses(out).items() if s > 10}
    assert got == {s: want[s] for s in range(11, STEPS + 1)}
