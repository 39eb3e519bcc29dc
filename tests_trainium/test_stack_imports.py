"""The environment itself: the pinned stack imports, with NxD's real modules (not the shim's) where the shim is silent."""

from __future__ import annotations

import importlib.metadata as md

import conftest


def test_pinned_versions() -> None:
    assert md.version("optimum-neuron") == "0.4.5"
    assert md.version("torch") == "2.9.0"
    assert md.version("torch-xla") == "2.9.0"
    assert int(md.version("transformers").split(".")[0]) == 4


def test_optimum_neuron_training_imports_nxd_from_the_vendored_source() -> None:
    from neuronx_distributed.parallel_layers import layers
    from optimum.neuron.models.training.checkpointing import (
        consolidate_model_parallel_checkpoints_to_unified_checkpoint,
    )

    assert callable(consolidate_model_parallel_checkpoints_to_unified_checkpoint)
    assert layers.__file__.startswith(str(conftest.NXD_SRC))
