"""optimum-neuron 0.4.5's own model classes load ckpt's ``--format optimum-neuron`` export on gloo ranks.

optimum-neuron 0.4.5's ``NeuronTrainer`` has no resume: ``train(resume_from_checkpoint=...)`` raises
(``trainers/transformers.py:1095-1096``, "`resume_from_checkpoint` is not supported by the NeuronTrainer.").  What
stands in is the path its save mirrors: the model built as NeuronTrainer builds it (``Cls(config, trn_config)`` from
the folder's ``config.json`` / ``trn_config.json``), the optimizer as ``create_optimizer`` builds it, and NxD's own
``load_checkpoint(folder, tag="shards", model, optimizer)``, the counterpart of ``save_pretrained``'s
``save_checkpoint`` (``models/training/modeling_utils.py:1480``); the scheduler from ``scheduler.pt``
(``_save_checkpoint``, ``trainers/transformers.py:1402``).  Rank bodies: ``_optimum_ranks.py``.

The source is a real ``transformers.Trainer`` checkpoint (``examples/hf_trainer.py``, 2 AdamW steps on the CPU) with
its optimizer, scheduler and ``training_args.bin``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import _optimum_ranks
import pytest
import torch
from ckpt.converters.convert import ConvertOptions, RunOptions, convert
from ranks import run_ranks
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
STEPS = 2


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    env = dict(os.environ, USE_TORCH_XLA="0", PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--out", str(out), "--steps", str(STEPS),
         "--save-every", str(STEPS)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return out / f"checkpoint-{STEPS}"


def moment_folders(checkpoint: Path, dst: Path) -> dict[str, str]:
    """The source optimizer's AdamW moments as HF model folders (the full tensors under the parameters' names),
    for optimum-neuron's ``from_pretrained`` to shard as it shards the weights.  The Trainer numbers its
    parameters decay group first (``Trainer.get_decay_parameter_names``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer

    config = AutoConfig.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_config(config)
    decay = set(Trainer.get_decay_parameter_names(None, model))
    names = [n for n, _ in model.named_parameters() if n in decay] + [
        n for n, _ in model.named_parameters() if n not in decay
    ]
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    assert len(state) == len(names)
    out = {}
    for key in ("exp_avg", "exp_avg_sq"):
        folder = dst / key
        folder.mkdir()
        config.save_pretrained(folder)
        save_file({n: state[i][key].contiguous() for i, n in enumerate(names)}, folder / "model.safetensors",
                  metadata={"format": "pt"})  # fmt: skip
        out[key] = str(folder)
    return out


@pytest.mark.parametrize(("tp", "platform"), [(2, "trn1"), (4, "trn2")])
def test_optimum_neuron_model_and_optimizer_load_our_export_equal_to_the_source(
    trainer_checkpoint: Path, tmp_path: Path, tp: int, platform: str
) -> None:
    """TP 2 (separate q/k/v projections) and TP 4 (GQAQKVColumnParallelLinear, 2 KV heads replicated twice), the
    second with NxD told it runs on trn2 (``NXD_SHIM_PLATFORM``): optimum-neuron's layout is the same there."""
    folder = tmp_path / f"checkpoint-{STEPS}"
    convert(str(trainer_checkpoint), str(folder), ConvertOptions.neuron(format="optimum-neuron", tp=tp, xser=False),
            RunOptions())  # fmt: skip
    assert (folder / "training_args.bin").read_bytes() == (trainer_checkpoint / "training_args.bin").read_bytes()
    job = {
        "export": str(folder), "source": str(trainer_checkpoint), "platform": platform, "optimizer": True,
        "weight_decay": 0.01, "lr": 3e-3, "max_steps": 20, "moments": ["exp_avg", "exp_avg_sq"],
        **moment_folders(trainer_checkpoint, tmp_path),
    }  # fmt: skip
    results = run_ranks(_optimum_ranks.load_rank, tp, job)
    source_sched = torch.load(trainer_checkpoint / "scheduler.pt", weights_only=True)
    for rank, r in enumerate(results):
        theirs, ours = r["metadata"]
        assert ours == theirs, f"rank {rank}: mp_metadata_pp_rank_0.json differs from create_parameter_metadata"
        assert r["weights_differ"] == [], rank
        assert r["state"] == r["parameters"], rank  # every parameter has its AdamW state
        assert r["moments_differ"] == [], rank
        assert r["steps"] == [float(STEPS)]
        assert [g["weight_decay"] for g in r["param_groups"]] == [0.01, 0.0]
        assert r["scheduler"][0] == source_sched["last_epoch"] == STEPS
        # NeuronTrainer 0.4.5 would decay the final norm, which the Trainer run did not (see _optimum_ranks.py)
        neuron, run = (set(g) for g in (r["decay_groups"]["neuron_trainer"], r["decay_groups"]["source_run"]))
        assert neuron - run == {"model.norm.weight"} and run <= neuron
    if tp == 4:
        assert any("qkv_proj.weight_k" in n for n in results[0]["parameters"])
