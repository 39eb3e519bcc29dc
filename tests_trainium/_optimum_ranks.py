"""Rank bodies for tests_trainium/test_optimum_resume.py: optimum-neuron 0.4.5's own model classes on gloo ranks
(NxD in CPU mode, torch_xla's collectives on gloo: tests/nxd_shim/xla_gloo.py), loading ckpt's export with NxD's
``load_checkpoint``, the call that mirrors ``save_pretrained``'s ``save_checkpoint`` (``modeling_utils.py:1480``).

Each rank builds the model twice from the export's own ``config.json`` and ``trn_config.json``
(``TrainingNeuronConfig(**trn_config)``, as ``save_pretrained`` wrote it from ``asdict``):

* ``reference``: ``from_pretrained(SOURCE, trn_config)``, optimum-neuron's own sharding of the source model
  (``adapt_state_dict``, ``transformations_utils.py:1516``);
* ``loaded``: NxD's ``load_checkpoint(export, tag="shards", model=..., optimizer=...)``, the optimizer built as
  ``NeuronTrainer.create_optimizer`` builds it (``trainers/transformers.py:569``: AdamW over a decay and a no-decay
  group) but with the source run's grouping: NeuronTrainer 0.4.5's ``get_decay_parameter_names`` (``:558-567``)
  decays ``model.norm.weight``, which transformers 4.57's Trainer does not, so the source's state would not load
  into its groups (``load_state_dict``: "a parameter group that doesn't match the size"); both groupings are
  returned and the test pins the difference.  The scheduler comes from the export's ``scheduler.pt``.

Compared in the rank (the values never leave it): the loaded parameters with the reference's, the loaded AdamW
moments with the source ``optimizer.pt``'s sharded the same way (``from_pretrained`` of a folder holding the full
moments under the parameters' names); returned: the names that differ, the step and param groups loaded, the
scheduler loaded from ``scheduler.pt``, and optimum-neuron's own ``create_parameter_metadata`` of the model with the
export's ``mp_metadata_pp_rank_0.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


def _model_class(model_type: str) -> Any:
    from optimum.neuron.models.training import LlamaForCausalLM, Qwen3ForCausalLM

    return {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}[model_type]


def load_rank(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    os.environ["NXD_SHIM_PLATFORM"] = job.get("platform", "trn1")
    import xla_gloo

    xla_gloo.install()
    from neuronx_distributed.trainer import load_checkpoint
    from optimum.neuron.models.training import (
        TrainingNeuronConfig,
        create_parameter_metadata,
        specialize_transformation_specs_for_model,
    )
    from transformers import AutoConfig

    folder = Path(job["export"])
    trn_config = TrainingNeuronConfig(**json.loads((folder / "trn_config.json").read_text()))
    config = AutoConfig.from_pretrained(folder)
    cls = _model_class(config.model_type)

    reference = cls.from_pretrained(job["source"], trn_config)
    model = cls(config, trn_config)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)  # what load_checkpoint must replace, all of it
    specialize_transformation_specs_for_model(model)
    theirs = create_parameter_metadata(model)
    ours = json.loads((folder / "shards" / "mp_metadata_pp_rank_0.json").read_text())

    optimizer = None
    if job.get("optimizer"):
        from transformers import Trainer
        from transformers.trainer_pt_utils import get_parameter_names

        # NeuronTrainer.get_decay_parameter_names (trainers/transformers.py:558-567) and the source run's own
        # (transformers 4.57 Trainer's, which also keeps every "norm" out of weight decay)
        neuron = set(get_parameter_names(model, [torch.nn.LayerNorm], ["bias", "layernorm", "rmsnorm"]))
        run = set(Trainer.get_decay_parameter_names(None, model))
        out_groups = {"neuron_trainer": sorted(neuron), "source_run": sorted(run)}
        decay = run
        groups = [
            {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": job["weight_decay"]},
            {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=job["lr"])
    # NxD loads a plain (not ZeRO-1) optimizer's state into a dict (trainer/checkpoint.py:898-904, :591-593): an
    # AdamW is neither its NxDOptimizer nor a NeuronZero1Optimizer
    optim_state: dict[str, Any] = {}
    load_checkpoint(str(folder), tag="shards", model=model, optimizer=optim_state if optimizer else None,
                    num_workers=1)  # fmt: skip
    if optimizer is not None:
        optimizer.load_state_dict(optim_state)
    loaded = dict(model.named_parameters())
    out: dict[str, Any] = {
        "parameters": sorted(loaded),
        "weights_differ": [n for n, p in reference.named_parameters() if not torch.equal(p, loaded[n])],
        "metadata": (json.loads(json.dumps(theirs)), ours),  # its spec tuples as JSON writes them
    }
    if optimizer is not None:
        # the moments the source's optimizer.pt holds, sharded by optimum-neuron's own from_pretrained
        moments = {key: dict(cls.from_pretrained(job[key], trn_config).named_parameters()) for key in job["moments"]}
        state = {n: optimizer.state[p] for n, p in loaded.items() if p in optimizer.state}
        out["state"] = sorted(state)
        out["moments_differ"] = [
            (n, key) for n in state for key in moments if not torch.equal(state[n][key], moments[key][n])
        ]
        out["decay_groups"] = out_groups
        out["steps"] = sorted({float(st["step"]) for st in state.values()})
        out["param_groups"] = [
            {k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])} for g in optimizer.param_groups
        ]
        from transformers.optimization import get_scheduler

        scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=5, num_training_steps=job["max_steps"])
        scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
        out["scheduler"] = (scheduler.last_epoch, scheduler.get_last_lr())
    return out
