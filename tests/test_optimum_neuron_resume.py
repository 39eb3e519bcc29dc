"""A real ``transformers.Trainer`` resumes from optimum-neuron ``checkpoint-N`` folders converted to Trainer folders.

1. The Trainium run: the NxD fixture's run (3 AdamW steps, saved by NxD's ``save_checkpoint``) in the folder
   optimum-neuron keeps, -> ``hf-trainer``: the resumed Trainer's next losses are that run's own continuation
   (``tests/_optimum_continue.py``).
2. A Trainer run -> optimum-neuron folder (our writer) -> Trainer resumes with the uninterrupted run's losses.

The runs are ``examples/hf_trainer.py`` (a real ``transformers.Trainer`` on CPU, ``USE_TORCH_XLA=0``), shared with
``test_integration_transformers.py``: ``straight`` (20 steps) and ``crashed`` (killed after step 12, newest
``checkpoint-10``).  ``checkpoint-10`` is written as the folder a NeuronTrainer run keeps (TP=2, tag ``shards/``,
the Trainer files at the root), and that folder, the Trainium side, converts back to a Trainer folder that
``Trainer.train(resume_from_checkpoint=...)`` continues from, bit for bit.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures" / "optimum_neuron"))
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


def _continue(*args: object) -> list[float]:
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "USE_TORCH_XLA": "0", "PYTHONWARNINGS": "ignore"}
    script = Path(__file__).resolve().parent / "_optimum_continue.py"
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_trainer_resumed_from_the_trainium_run_continues_its_losses(tmp_path: Path) -> None:
    """The NxD-saved run (3 AdamW steps, TP 2 DP 2 ZeRO-1, xser) as optimum-neuron keeps it -> hf-trainer -> a real
    Trainer resumes; its steps 4 and 5 are the run's own continuation (same batch) to float rounding: step 5 needs
    the moments, the step count and the scheduler's lr (without optimizer.pt its loss is off by ~8e-2)."""
    import build as on_build  # fixtures/optimum_neuron
    import pytest

    ck = on_build.build(tmp_path / "run", "xser")
    convert(ck, tmp_path / "checkpoint-3", "--from", "neuron", "--to", "cuda", "--format", "hf-trainer")
    want = _continue("truth")
    got = _continue("trainer", tmp_path / "checkpoint-3", tmp_path / "out")
    assert got == pytest.approx(want, rel=1e-6, abs=0)
    assert abs(got[1] - got[0]) > 1e-3  # the step between them moved the weights
